# ruff: noqa
# A wrong answer to labs/lab10_pytorch_twins.ipynb (the other answers are the solution's). The bug: the K/V style
# knows each rank's gradient of the K/V head is a share, but leaves it Partial (to_local(grad_placements=Partial)):
# the numbers are right once the ranks' pieces are summed, but the weights' gradients stay Partial (a sum still owed
# before the update), and x's gradient from k and v is summed as a whole [B, T, H] each, not at k's and v's narrow
# output: two all-reduces of [B, T, H] per layer where two of [B, T, nkv hd] do. Parts 2, 3 and 4 put their own
# style on k and v.
# EXPECT FAIL: tp_plan

# ANSWER: tp_plan
def tp_plan(model):
    plan = {}
    for i in range(len(model.blocks)):
        b = f"blocks.{i}"
        plan[f"{b}.attn.q"] = ColwiseParallel()
        plan |= {f"{b}.attn.{w}": WholeKV() for w in ("k", "v")}
        plan[f"{b}.attn.o"] = RowwiseParallel()
        plan |= {f"{b}.mlp.{w}": ColwiseParallel() for w in ("gate", "up")}
        plan[f"{b}.mlp.down"] = RowwiseParallel()
    return plan


class WholeKV(ParallelStyle):
    def _apply(self, module, mesh):
        def take_input(module, inputs, mesh):
            x = inputs[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
            return (x, *inputs[1:])

        def give_output(module, output, mesh):
            return output.to_local(grad_placements=(Partial(),))

        return distribute_module(module, mesh, input_fn=take_input, output_fn=give_output)

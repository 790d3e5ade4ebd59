# ruff: noqa
# A wrong answer to labs/lab10_pytorch_twins.ipynb (the other answers are the solution's). The bug: part 2's plan
# handed in as part 1's: besides one style per Linear it puts a PrepareModuleInput on each sub-layer. Its numbers are
# right and its traffic is less, but it is not the plan part 1 asks for (one style per Linear, nothing else): the
# check reads the plan's keys. Part 2 adds the same styles again (and its own K/V style), which changes nothing.
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
        plan[f"{b}.attn"] = PrepareModuleInput(
            input_layouts=(Replicate(), None), desired_input_layouts=(Replicate(), None), use_local_output=False
        )
        plan[f"{b}.mlp"] = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False
        )
    return plan


class WholeKV(ParallelStyle):
    def _apply(self, module, mesh):
        def take_input(module, inputs, mesh):
            x = inputs[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
            return (x, *inputs[1:])

        def give_output(module, output, mesh):
            local = output.to_local()
            return DTensor.from_local(local, mesh, (Replicate(),), run_check=False).to_local(
                grad_placements=(Partial(),)
            )

        return distribute_module(module, mesh, input_fn=take_input, output_fn=give_output)

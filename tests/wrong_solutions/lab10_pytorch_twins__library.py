# ruff: noqa
# A wrong answer to labs/lab10_pytorch_twins.ipynb (the other answers are the solution's). The bug: the plan is
# parlab's own twin plan for the reference GPT (parlab.twins.tensor.tp_plan), renamed to the lab model's modules
# (proj -> o and down, fc -> gate, plus up), with k and v given a whole-K/V-head style (the twin's GPT splits every
# projection by heads, which one K/V head on two ranks does not allow). It runs and its numbers and traffic are
# right; every part that builds on it fails on the line naming the call (megatron_plan and vocab_plan start from
# tp_plan).
# EXPECT FAIL: tp_plan, megatron_plan, vocab_parallel

# ANSWER: tp_plan
from parlab.twins.tensor import tp_plan as twin_plan


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


def tp_plan(model):
    renamed = {"attn.proj": "attn.o", "mlp.fc": "mlp.gate", "mlp.proj": "mlp.down"}
    plan = {}
    for name, style in twin_plan(len(model.blocks)).items():
        if not name.startswith("blocks."):
            continue
        for old, new in renamed.items():
            name = name.replace(old, new)
        plan[name] = WholeKV() if name.endswith(("attn.k", "attn.v")) else style
        if name.endswith("mlp.gate"):
            plan[name.replace("gate", "up")] = ColwiseParallel()
    return plan

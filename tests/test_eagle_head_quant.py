"""`eagle` with `head_quant=True`: the head's linears carry the target's own quantization (issue 51 item 3)."""

import torch

import specdec
from specdec.drafters import build

PROMPT = [3, 17, 5, 9, 22, 5, 9, 22, 5, 9]


def test_head_quant_quantizes_the_head_like_the_target_and_drafts():
    target = specdec.load_target("tiny-llama", quant="torchao_int8", kernel="torch", threads=1)
    plain, quantized = (build("eagle", target=target, head="random", head_quant=q) for q in (False, True))
    assert type(plain.head.fc.weight) is torch.nn.Parameter and type(plain.head.fc.weight.data) is torch.Tensor
    kind = type(target.model.model.layers[0].mlp.up_proj.weight)
    assert type(quantized.head.fc.weight) is kind and kind is not torch.nn.Parameter  # the target's weight class
    want = specdec.generate(target, None, PROMPT, max_new_tokens=10, stop_on_eos=False).token_ids
    out = specdec.generate(target, quantized, PROMPT, shape="chain(3)", max_new_tokens=10, stop_on_eos=False)
    assert len(out.token_ids) == 10 and sum(s.drafted for s in out.stats.steps) > 0
    assert out.token_ids == want  # fp32 arithmetic on int8 weights: the drafted text is the plain one here
    none = specdec.load_target("tiny-llama", kernel="torch", threads=1)  # an unquantized target: nothing to do
    assert type(build("eagle", target=none, head="random", head_quant=True).head.fc.weight.data) is torch.Tensor

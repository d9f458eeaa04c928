"""minirl's vLLM-CPU LoRA ops (`minirl.sync.cpu_lora`, put in place through `minirl.sync.vllm_compat`) against vLLM's own torch ops: the same product,
without the per-token copy of the adapter. The real engine runs them in every vLLM test (they are installed in its
worker); `test_vllm.py::test_engine_uses_minirls_cpu_lora_ops` checks that they are the ones it runs."""
import pytest
import torch

pytest.importorskip("vllm")
from vllm.lora.ops.torch_ops import lora_ops  # noqa: E402
from vllm.lora.punica_wrapper import punica_cpu  # noqa: E402

from minirl.sync import cpu_lora  # noqa: E402

NAMES = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")
ORIG = {n: getattr(lora_ops, n) for n in NAMES}
FAST = cpu_lora._ops(ORIG)


def _case(slots, tokens, d_in, d_out, idx, four_d, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(slots, d_out, d_in, generator=g)
    w = w.unsqueeze(1) if four_d else w
    return torch.randn(tokens, d_in, generator=g), w, torch.tensor(idx)


@pytest.mark.parametrize("four_d", [False, True])
@pytest.mark.parametrize("idx", [[0, 0, 0, 0, 0], [2, 2, 2, 2, 2], [0, 1, 1, 2, 0]])
def test_the_ops_do_what_vllms_do(idx, four_d):
    x, w, i = _case(3, len(idx), 24, 40, idx, four_d)
    for add in (False, True):
        a, b = torch.randn(len(idx), 48), None
        b = a.clone()
        ORIG["bgmv_expand"](x, w, a, i, add)
        FAST["bgmv_expand"](x, w, b, i, add)
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        a, b = torch.randn(len(idx), 100), None
        b = a.clone()
        ORIG["bgmv_expand_slice"](x, w, a, i, 30, 40, add)
        FAST["bgmv_expand_slice"](x, w, b, i, 30, 40, add)
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    xs, ws, _ = _case(3, len(idx), 40, 8, idx, four_d, seed=1)
    a = torch.zeros(len(idx), 8)
    b = a.clone()
    ORIG["bgmv_shrink"](xs, ws, a, i, 0.5)
    FAST["bgmv_shrink"](xs, ws, b, i, 0.5)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_a_token_without_lora_gets_no_lora_term():
    """-1 is vLLM's "no LoRA should be applied": those rows stay as they were (vLLM's torch ops use slot -1)."""
    x, w, i = _case(2, 4, 16, 8, [1, -1, 1, -1], False)
    y0 = torch.randn(4, 8)
    y = y0.clone()
    FAST["bgmv_expand"](x, w, y, i, True)
    torch.testing.assert_close(y[[1, 3]], y0[[1, 3]], rtol=0, atol=0)
    torch.testing.assert_close(y[[0, 2]], y0[[0, 2]] + x[[0, 2]] @ w[1].t(), rtol=1e-5, atol=1e-5)
    z = torch.zeros(4, 8)
    FAST["bgmv_expand"](x, w, z, torch.tensor([-1] * 4), False)
    assert not z.any()


def test_shapes_it_does_not_handle_go_to_vllms_op():
    x, w, _ = _case(2, 3, 16, 8, [0, 0, 0], False)
    calls = []
    fast = cpu_lora._ops({**ORIG, "bgmv_expand": lambda *a: calls.append(a)})
    fast["bgmv_expand"](x, w, torch.zeros(3, 8), torch.tensor([0, 0]), True)  # 2 indices for 3 tokens
    assert len(calls) == 1


def test_install_replaces_vllms_cpu_ops_and_the_prefill_path_uses_them(monkeypatch):
    for module in (lora_ops, punica_cpu):
        for n in NAMES:  # start from vLLM's own ops (another test in this process may have installed minirl's)
            monkeypatch.setattr(module, n, ORIG[n])  # and whatever was there is restored after the test
    for flag in ("_minirl_cpu_lora", "_minirl_orig"):
        monkeypatch.setattr(lora_ops, flag, None, raising=False)
        monkeypatch.delattr(lora_ops, flag)
    monkeypatch.setenv("MINIRL_VLLM_CPU_LORA", "0")
    assert cpu_lora.install_default() is False and punica_cpu.bgmv_expand is ORIG["bgmv_expand"]
    monkeypatch.delenv("MINIRL_VLLM_CPU_LORA")
    assert cpu_lora.install_default() is True
    assert all(getattr(m, n) is not ORIG[n] for m in (lora_ops, punica_cpu) for n in NAMES)
    x, w, _ = _case(2, 5, 16, 8, [0] * 5, False)
    y = torch.zeros(5, 8)
    seen = []
    monkeypatch.setattr(cpu_lora, "lora_matmul", lambda *a: seen.append(a) or cpu_lora.torch.zeros(5, 8))
    lora_ops.sgmv_expand(x, w, y, torch.tensor([0, 2]), torch.tensor([2, 3]), torch.tensor([1, 0]), 2, 3, 5, True)
    assert len(seen) == 1 and seen[0][2].tolist() == [1, 1, 0, 0, 0]  # per-sequence slots, one per token
    assert cpu_lora.install(False) is False  # and back: vLLM's own ops
    assert all(getattr(m, n) is ORIG[n] for m in (lora_ops, punica_cpu) for n in NAMES)

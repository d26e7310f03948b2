"""``+strategy=chunked_loss``: the loss and gradients of the chunked output projection + cross-entropy
against a float64 reference written out by hand (softmax - one-hot), the plain fp32 trajectory, and
the activation bytes it saves against the formula 4 x batch x seq x vocab (fp32 log-softmax)."""
from __future__ import annotations

import pytest
import torch

from memopt.errors import ConfigError
from memopt.strategies.chunked_loss import IGNORE_INDEX, ChunkedCrossEntropy
from tests.conftest import losses, train, typed


def reference(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor):
    """float64 loss, dL/dx, dL/dW of mean_i -log softmax(x_i W^T)[t_i] over the kept rows."""
    x, w = x.double(), w.double()
    keep = t != IGNORE_INDEX
    z = x @ w.t()
    z = z - z.max(dim=1, keepdim=True).values
    p = z.exp() / z.exp().sum(dim=1, keepdim=True)
    tt = t.clamp_min(0)
    n = keep.sum().double()
    loss = -(p.log().gather(1, tt[:, None]).squeeze(1) * keep).sum() / n
    d = p.clone()
    d[torch.arange(len(t)), tt] -= 1.0
    d = d * keep[:, None] / n
    return loss, d @ w, d.t() @ x


@pytest.mark.parametrize("dtype, chunk, tol", [(torch.float64, 7, 1e-12), (torch.float32, 5, 2e-6), (torch.float32, 64, 2e-6)])
def test_loss_and_grads_match_float64_reference(dtype, chunk, tol):
    g = torch.Generator().manual_seed(0)
    N, C, V = 23, 16, 37  # chunks that do not divide N, and one chunk larger than N
    x = torch.randn(N, C, generator=g, dtype=dtype, requires_grad=True)
    w = (torch.randn(V, C, generator=g, dtype=dtype) * 0.5).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g)
    t[3] = IGNORE_INDEX
    loss = ChunkedCrossEntropy.apply(x, w, t, chunk)
    (loss * 3.0).backward()  # a non-unit upstream gradient
    rl, rdx, rdw = reference(x.detach(), w.detach(), t)
    torch.testing.assert_close(loss.double(), rl, rtol=tol, atol=tol)
    torch.testing.assert_close(x.grad.double(), 3.0 * rdx, rtol=tol, atol=tol)
    torch.testing.assert_close(w.grad.double(), 3.0 * rdw, rtol=tol, atol=tol)


def test_refuses_non_positive_chunk():
    with pytest.raises(ConfigError, match="strategy.chunked_loss.chunk_tokens=0"):
        typed(["+strategy=chunked_loss", "strategy.chunked_loss.chunk_tokens=0"])


def test_refused_by_engines_without_it():
    with pytest.raises(ConfigError, match="chunked_loss"):
        typed(["engine=fsdp2", "+strategy=[zero3,chunked_loss]"])


# One plain and one chunked run of gpt_tiny with a 4096-token vocabulary (targets stay bytes: the
# memory and the math do not depend on which ids occur): the logits are then most of the activations.
B, T, V = 4, 32, 4096
RUN = ["model=gpt_tiny", f"model.seq_len={T}", f"model.vocab_size={V}", "trainer.max_steps=2", "trainer.log_every=1",
       "trainer.eval_every=0", f"trainer.micro_batch_size={B}", "data=synthetic", "optim.lr=3e-3", "optim.warmup_steps=1"]


def test_same_trajectory_and_activation_saving_of_the_formula(tmp_path):
    plain = train(RUN, str(tmp_path / "plain"))
    chunked = train(RUN + ["+strategy=chunked_loss", "strategy.chunked_loss.chunk_tokens=48"], str(tmp_path / "chunked"))
    assert plain["status"] == chunked["status"] == "ok", (plain, chunked)
    lp, lc = losses(str(tmp_path / "plain")), losses(str(tmp_path / "chunked"))
    assert len(lp) == len(lc) == 2 and max(abs(a - b) / abs(b) for a, b in zip(lc, lp)) <= 1e-5, (lc, lp)
    act = [s["peak_bytes"]["0"]["cpu"]["activations"] for s in (plain, chunked)]
    tot = [s["peak_bytes"]["0"]["cpu"]["total"] for s in (plain, chunked)]
    formula = 4 * B * T * V  # fp32 log-softmax autograd keeps for the plain head (fp32 run: logits are dropped)
    lse = 4 * B * T  # what the chunked head keeps instead
    # exact up to the scalars: the plain nll_loss keeps a 4-byte total weight, the chunked head an 8-byte count
    assert act[0] - act[1] == formula - lse + 4 - 8, (act, formula)
    # at these shapes the optimizer step, not the backward, sets the total peak: it must not grow
    assert tot[1] <= tot[0], tot


@pytest.mark.slow
@pytest.mark.parametrize("extra, tol", [
    (["+strategy=[zero3,chunked_loss]", "trainer.nproc_per_node=2"], 1e-5),  # the head's weight gathered through the backward
    (["+strategy=[bf16,chunked_loss]", "strategy.bf16.params=bf16"], 4e-2),  # bf16 logits, fp32 softmax (parity tests' tolerance)
], ids=["zero3-2ranks", "bf16"])
def test_follows_the_plain_fp32_run(tmp_path, extra, tol):
    base = [o for o in RUN if not o.startswith("model.vocab_size")]  # byte vocabulary: the bf16 head stays cheap
    plain = train(base, str(tmp_path / "plain"))
    got = train(base + extra + ["strategy.chunked_loss.chunk_tokens=48"], str(tmp_path / "got"))
    assert plain["status"] == got["status"] == "ok", got
    lp, lg = losses(str(tmp_path / "plain")), losses(str(tmp_path / "got"))
    assert max(abs(a - b) / abs(b) for a, b in zip(lg, lp)) <= tol, (lg, lp)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_softmax_grad_is_the_plain_one_to_the_bit(dtype):
    """The GPU's three-pass softmax gradient (``fused``) against the five-pass one a CPU runs: the same bits,
    both against (softmax - one-hot) x coef in float64 (an ignored target's row is all softmax x 0)."""
    from memopt.strategies.chunked_loss import softmax_grad

    g = torch.Generator().manual_seed(3)
    logits = (3 * torch.randn(37, 201, generator=g)).to(dtype)
    lse = torch.logsumexp(logits.float(), dim=-1)
    t = torch.randint(0, 201, (37,), generator=g)
    t[4] = IGNORE_INDEX
    coef = torch.rand(37, generator=g) * (t != IGNORE_INDEX)
    # a fresh copy each: in the loss the logits are the chunk's own product, which the plain form reuses in place
    fused, plain = (softmax_grad(logits.clone(), lse, t, coef, dtype, fused=f) for f in (True, False))
    assert fused.dtype == plain.dtype == dtype and torch.equal(fused, plain)
    want = torch.softmax(logits.double(), dim=-1)
    rows = torch.arange(37)[t != IGNORE_INDEX]
    want[rows, t[rows]] -= 1
    want *= coef.double()[:, None]
    assert torch.allclose(fused.double(), want, rtol=1e-2 if dtype != torch.float32 else 1e-5, atol=1e-6)

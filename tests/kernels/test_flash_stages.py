"""The causal stage split of the FlashAttention kernels, over block geometries.

Each kernel runs its tiles in stages: unmasked off-band tiles, masked diagonal
tiles, and (when N is not a multiple of the tile) a ragged last tile masked
against the sequence end.  A wrong stage bound shows up only for some block
geometries and lengths, so these tests force the interpreter's block sizes
(square, key tiles wider than query blocks, and the default taller ones) and
pick lengths that hit each kind of bound: shorter than one block, exactly one
diagonal tile, several off-band tiles plus a ragged diagonal one, an exact
multiple of the tile (the off-band stage reaches the end unmasked), and
non-causal Nq != Nk.

Two references, both independent of the kernel: inputs whose scores are all
exactly 0, so the softmax is uniform over the keys a row may see and P is known
in closed form (then O, dQ, dK, dV follow from the FlashAttention backward
formulas in float64, and a row or column that sees one key too many or too few
is named); and random inputs against the float64 softmax reference.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (needed for the FlashAttention kernels)")

from memopt.kernels import flash_attn as fa  # noqa: E402
from tests.kernels import test_flash_attn as base  # noqa: E402

DEVICE, TOL, needs_kernel = base.DEVICE, base.TOL, base.needs_kernel
poison = base.poison  # the fixture that NaN-fills every kernel output buffer

F32, F16 = torch.float32, torch.float16

# (forward (BLOCK_M, BLOCK_N), dK/dV (query step, keys owned), dQ (queries owned, key step))
GEOMETRIES = {
    "square16": dict(fwd=(16, 16), dkdv=(16, 16), dq=(16, 16)),
    "keys-wider": dict(fwd=(16, 32), dkdv=(32, 16), dq=(16, 32)),
    "keys-narrower": dict(fwd=(32, 16), dkdv=(16, 32), dq=(32, 16)),  # the interpreter's default
}
# A causal length of exactly one diagonal tile per geometry: one 16x16 tile; one
# 32-key tile that is diagonal for both 16-row query blocks; one 32-row query
# block over two 16-key diagonal tiles.
ONE_TILE = {"square16": 16, "keys-wider": 32, "keys-narrower": 32}


@pytest.fixture
def blocks(monkeypatch):
    """Force the fixed block sizes of one geometry (also on CUDA: autotuning is switched off)."""
    used = []

    def force(name):
        geom = GEOMETRIES[name]

        def fixed(head_dim, interpreted, elem_size=2):
            used.append(name)
            return fa._Blocks(**geom, num_warps=4, num_stages=1)

        monkeypatch.setattr(fa, "_fixed_blocks", fixed)
        monkeypatch.setenv("MEMOPT_FLASH_NO_AUTOTUNE", "1")
        return used

    return force


def _lengths(geom):
    """(Nq, Nk, causal) cases for one geometry, each aimed at one kind of stage bound."""
    return [
        (7, 7, True),  # shorter than every block: only the diagonal stage, ragged
        (ONE_TILE[geom], ONE_TILE[geom], True),  # exactly one diagonal tile, nothing ragged
        (41, 41, True),  # off-band tiles, a ragged diagonal tile; dK/dV: ragged off-band query tile
        (64, 64, True),  # exact multiple: the off-band stage runs to the end unmasked
        (23, 41, False),  # whole key tiles, then the ragged last one
        (41, 16, False),  # one whole key tile, no ragged one; ragged query blocks
    ]


# Scores all exactly 0, or all exactly -100: then LSE < -88 and a zero-filled key
# past the sequence end would get exp(-LSE) = inf (fp32) unless it is masked.
UNIFORM_CASES = [(g, *c, 0.0) for g in GEOMETRIES for c in _lengths(g)]
UNIFORM_CASES += [(g, 41, 41, True, -100.0) for g in GEOMETRIES] + [(g, 23, 41, False, -100.0) for g in GEOMETRIES]


def _id(case):
    g, nq, nk, causal, extra = case
    tail = f"score{extra:g}" if isinstance(extra, float) else str(extra).split(".")[-1]
    return f"{g}-q{nq}k{nk}-{'causal' if causal else 'full'}-{tail}"


def _uniform_inputs(nq, nk, d, score):
    """Inputs with every score exactly ``score`` (scale 1/4, d = 16), so P is uniform over the keys seen.

    q_i = e_2 + (4 score / 10) e_4 and k_j = (j / nk) e_0 + 10 e_4: the e_0/e_2
    parts are orthogonal and the e_4 parts give q_i . k_j / 4 = score exactly.
    v_j = (j / nk) e_0 + e_1 makes O_i[0] the mean index of the keys row i saw and
    O_i[1] their total weight (1); dO_i = e_0 + ((i + 1) / nq) e_1 gives every
    (i, j) a different dP_ij, so a missing or extra (i, j) pair changes dQ and dK.
    """
    q = torch.zeros(1, 1, nq, d, dtype=torch.float64)
    k = torch.zeros(1, 1, nk, d, dtype=torch.float64)
    v = torch.zeros(1, 1, nk, d, dtype=torch.float64)
    do = torch.zeros(1, 1, nq, d, dtype=torch.float64)
    j = torch.arange(nk, dtype=torch.float64) / nk
    q[..., 2] = 1.0
    q[..., 4] = 4.0 * score / 10.0
    k[..., 4] = 10.0
    k[..., 0] = j
    v[..., 0] = j
    v[..., 1] = 1.0
    do[..., 0] = 1.0
    do[..., 1] = torch.arange(1, nq + 1, dtype=torch.float64) / nq
    return q, k, v, do


def _uniform_reference(q, k, v, do, causal, scale):
    """O, dQ, dK, dV in float64 with P = (visible keys) / (their count), no softmax involved."""
    nq, nk = q.shape[-2], k.shape[-2]
    seen = torch.ones(nq, nk, dtype=torch.float64)
    if causal:
        seen = seen.tril()
    p = seen / seen.sum(1, keepdim=True)
    o = p @ v
    dv = p.transpose(-1, -2) @ do
    dp = do @ v.transpose(-1, -2)
    ds = p * (dp - (p * dp).sum(-1, keepdim=True))
    return o, scale * ds @ k, scale * ds.transpose(-1, -2) @ q, dv


def _bad_rows(got, want, tol):
    close = torch.isclose(got, want, atol=tol["atol"], rtol=tol["rtol"]).all(-1).flatten()
    return (~close).nonzero().flatten().tolist()


@needs_kernel
# At score -100 rows and columns a kernel computes but never stores (past N) and
# masked-out entries overflow exp2 before they are discarded; numpy under the
# interpreter warns about it.  Stored values are checked below (NaN fails).
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("case", UNIFORM_CASES, ids=_id)
def test_stage_bounds_uniform_scores(case, blocks):
    """Every row sees exactly its keys: O, dQ (per query row) and dK, dV (per key row) match P's closed form,
    also when the scores are so negative that an unmasked key past the end would overflow."""
    geom, nq, nk, causal, score = case
    used = blocks(geom)
    d = 16
    scale = 1.0 / math.sqrt(d)
    q64, k64, v64, do64 = _uniform_inputs(nq, nk, d, score)
    assert torch.equal(scale * q64 @ k64.transpose(-1, -2), torch.full((1, 1, nq, nk), score, dtype=torch.float64))
    q, k, v = (t.to(F32).to(DEVICE).requires_grad_() for t in (q64, k64, v64))
    out = fa.flash_attn(q, k, v, causal=causal)
    out.backward(do64.to(F32).to(DEVICE))
    assert used, "the forced block sizes were not used"
    want = _uniform_reference(q64, k64, v64, do64, causal, scale)
    got = (out.detach(), q.grad, k.grad, v.grad)
    # At score -100 the kernel's fp32 LSE (~100) carries ~1e-5 absolute rounding,
    # so recomputed probabilities are off by ~1e-5 relative: 2e-4 (a mask error
    # is O(1e-2) or NaN).
    tol = TOL[F32] if score == 0.0 else dict(atol=2e-4, rtol=2e-4)
    bad = {
        name: rows for name, g, w in zip(("O rows", "dQ rows", "dK keys", "dV keys"), got, want)
        if (rows := _bad_rows(g.cpu().double(), w, tol))
    }
    assert not bad, f"{geom} blocks {GEOMETRIES[geom]}: wrong at {bad}"


RANDOM_CASES = [
    (g, n, n, True, dt) for g in ("square16", "keys-wider") for n, dt in ((41, F32), (64, F16))
] + [(g, 23, 41, False, F32) for g in ("square16", "keys-wider")]


@needs_kernel
@pytest.mark.parametrize("case", RANDOM_CASES, ids=_id)
def test_stage_bounds_random(case, blocks, poison):
    """Random inputs (online-softmax rescaling across the stages) against the float64 softmax reference."""
    geom, nq, nk, causal, dtype = case
    used = blocks(geom)
    gen = torch.Generator().manual_seed(nq * 13 + nk)
    q, k, v = base.make_qkv(1, 2, nq, nk, 16, dtype, gen)
    base.check_against_reference(q, k, v, causal)
    assert used and len(poison) == 6

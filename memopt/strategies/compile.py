"""``+strategy=compile``: ``torch.compile`` of each transformer block's forward (the regional compile
torchtitan uses: one small graph per block, reused by every block, instead of one whole-model graph).

What it buys: inductor fuses the point-wise operators of a block into few kernels, and AOTAutograd's
min-cut partitioner chooses which forward tensors the backward keeps. ``remat`` sets how far it may
recompute (``docs/design.md``, "Compile"):

    inductor    PyTorch's defaults. They ban recomputing an output the backward must materialise
                anyway (an input of a matmul's weight gradient), so on a GPT block, where every
                point-wise output feeds a Linear, nothing is dropped: the bytes equal eager's
    pointwise   (default) those bans lifted: the LayerNorm outputs and GELU's output, inputs of the
                next Linear, are recomputed in the backward from the tensors it keeps anyway (the
                LayerNorm input and statistics, the GELU input): 6 B T C values per GPT block
    aggressive  the partitioner's aggressive mode: any allow-listed (point-wise, view) op, more still
Matmul and attention outputs are recomputed in none of them (that is ``+strategy=ckpt``).

Only the block's ``forward`` is compiled, so the module call and its hooks stay eager: ZeRO-3's
and the chunk engine's gathers, FSDP2's unshard, tensor parallelism's DTensor wrapping all run as
without compile, and parameter names are unchanged (checkpoints, model.pt).

The memory tracker is a dispatch mode, and the compiled code does not pass through dispatch modes
(inductor's kernels allocate their buffers directly; and under an active mode the compiled function
runs eagerly: measured, the tracker then saw eager's bytes). So the region runs with the modes set aside, and the tracker counts what the region hands
back: its outputs, and, through a saved-tensor pack hook, each tensor the compiled graph saves for
its backward (``MemoryTracker.count``). Buffers that live and die inside the region are not seen
(they only move the ``temp`` peak). Under a checkpoint (``ckpt``, ``act_offload``) the pack hook
counts the tensor and hands it on to the checkpoint's own hooks, which decide what is kept. The
collectives counter (``trainer.count_comm``, a dispatch mode too) is set aside with it: collectives
inside a compiled block (tensor parallelism's) are not counted.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack

from memopt.errors import ConfigError
from memopt.strategies.base import Build, Strategy, register

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass
class CompileConfig:
    """``+strategy=compile``: which inductor mode compiles each block."""

    mode: str = "default"  # an inductor mode (see torch.compile); default keeps the min-cut partitioner
    dynamic: bool = False  # false: one graph per input shape (the training shape is fixed)
    remat: str = "pointwise"  # inductor | pointwise | aggressive: what the partitioner may recompute


# the partitioner's settings per ``remat`` (torch._functorch.config), applied while a block compiles
REMAT = {
    "inductor": {},
    "pointwise": {"ban_recompute_materialized_backward": False, "ban_recompute_used_far_apart": False,
                  "ban_recompute_long_fusible_chains": False},
    "aggressive": {"aggressive_recomputation": True},
}


class CompiledForward:
    """A block's forward, compiled; run with the dispatch modes set aside and measured by the tracker.

    Under a fake-tensor mode (the planner's dry run) the eager forward runs instead: the planner
    counts what the eager block would keep, an upper bound of the compiled block's."""

    def __init__(self, eager, opts: CompileConfig, tracker):
        self.eager, self.tracker, self.remat = eager, tracker, REMAT[opts.remat]
        self.compiled = self._with_remat(torch.compile(eager, mode=opts.mode, dynamic=opts.dynamic))

    def _with_remat(self, fn):
        """``fn`` under the partitioner settings (read when a graph is compiled, on the first call)."""
        import torch._functorch.config as functorch_config

        def run(*args):
            with functorch_config.patch(**self.remat):
                return fn(*args)
        return run

    def __call__(self, *args):
        stack = _get_current_dispatch_mode_stack()
        if any(isinstance(m, torch._subclasses.FakeTensorMode) for m in stack):
            return self.eager(*args)
        tracker = self.tracker if self.tracker in stack else None
        if tracker is None and not stack:
            return self.compiled(*args)
        with _disable_current_modes():
            if tracker is None:
                out = self.compiled(*args)
            else:
                # a checkpoint's hooks, when inside one: ours count each saved tensor and hand it on to them
                outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
                with torch.autograd.graph.saved_tensors_hooks(*_hooks(tracker, outer)):
                    out = self.compiled(*args)
        if tracker is not None:
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor):
                    tracker.count(t)
        return out


def _hooks(tracker, outer):
    """Saved-tensor hooks that count each tensor the compiled graph saves (a storage the tracker knows,
    the block input or a parameter, is not counted twice), then hand it to the ``outer`` hooks when
    there are some (a checkpoint's, which drop it and recompute it in the backward). A tensor is
    counted while it lives: a checkpoint's forward frees it when the region returns."""
    outer_pack, outer_unpack = outer if outer is not None else (None, None)

    def pack(t: torch.Tensor):
        tracker.count(t)
        return t if outer_pack is None else outer_pack(t)

    def unpack(p):
        return p if outer_unpack is None else outer_unpack(p)
    return pack, unpack


# strategy -> why it does not compose with compile (the registry's ``excludes`` reads the keys)
_CHUNK = ("the chunk engine fetches and releases chunks in hooks on every Linear inside a block, which a compiled "
          "block would trace into its graph (measured: more activation bytes counted than eager); memopt's zero3 and "
          "FSDP2 gather whole blocks outside the graph and compose with compile")
REFUSED = {
    "flash_attn": "flash_attn's Triton kernels are launched from Python (the interpreter on CPU) and are not "
                  "registered as custom operators dynamo can trace; use the model's sdpa attention under compile",
    "chunk": _CHUNK, "static_partition": _CHUNK, "hybrid_adam": _CHUNK,
}


@register
class Compile(Strategy):
    name, Config, phase, order = "compile", CompileConfig, "model", 60  # last: it compiles what the others built
    excludes = tuple(REFUSED)
    excludes_why = REFUSED

    def validate(self, c: CompileConfig, cfg) -> None:
        if c.mode not in MODES:
            raise ConfigError(f"strategy.compile.mode={c.mode!r} is not an inductor mode; use one of: {', '.join(MODES)}")
        if c.mode == "reduce-overhead" and cfg.trainer.device != "cuda":
            raise ConfigError("strategy.compile.mode=reduce-overhead captures CUDA graphs; on trainer.device="
                              f"{cfg.trainer.device} use strategy.compile.mode=default")
        if c.remat not in REMAT:
            raise ConfigError(f"strategy.compile.remat={c.remat!r} is not a recomputation setting; use one of: {', '.join(REMAT)}")
        if cfg.engine.name == "deepspeed" and cfg.strategy.zero3 is not None:
            raise ConfigError("strategy compile with engine=deepspeed and strategy zero3 is refused: DeepSpeed's ZeRO-3 "
                              "hooks every sub-module, so each block's graph breaks at every Linear and nothing is left "
                              "to recompute (measured: 5% of the saving); use engine=memopt or engine=fsdp2 with zero3, "
                              "or DeepSpeed with zero1/zero2")
        if cfg.trainer.mode == "plan":
            raise ConfigError("strategy compile is not planned: which point-wise outputs inductor recomputes is "
                              "decided when the block is compiled, not from the config; plan without +strategy=compile "
                              "(the eager plan is an upper bound of the compiled run's bytes), or measure it with "
                              "trainer.mode=train")

    def apply(self, model, c: CompileConfig, build: Build) -> None:
        # each run starts from an empty dynamo cache: it is per code object (Block.forward), does not
        # guard on the partitioner's settings (a later run with another ``remat`` would reuse the first
        # one's graphs) and holds 8 entries, after which a block runs eagerly without a word (runs of
        # other shapes in one process); inductor's on-disk cache still spares the recompilation
        torch._dynamo.reset()
        for block in model.blocks:
            block.forward = CompiledForward(block.forward, c, build.tracker)

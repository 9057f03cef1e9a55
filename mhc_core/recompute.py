"""mHC recompute: the n-stream states inside a group of sublayers are rebuilt in backward, not kept.

Legend: s sequence, b micro-batch, C hidden size, n residual streams, T = s*b.

Between two mHC sublayers the residual is one `[s, b, n*C]` state, `x_{k+1} =
post_residual_bda(H_res_k, x_k, h_post_k, (y_k, bias_k))`. Autograd keeps every state, since the
next sublayer's mapping, aggregation and mix save their input: n times the activation memory of
a plain residual per sublayer. A `StreamRecompute` group keeps only its first state (the anchor)
and what each mix needs besides the state (`H_res [T, n, n]`, `h_post [T, n]`, `y [T, C]`,
`bias`, the RNG state when dropout is on); states `x_1 .. x_K` are dropped from autograd's saved
tensors and, in backward, rebuilt in forward order from the anchor, bitwise (same ops, same
inputs, same dropout masks). This is what upstream Megatron-LM main does with `"mhc"` in
`recompute_modules` and its checkpoint manager; here it is done with
`torch.autograd.graph.saved_tensors_hooks`, independent of megatron-core:

    group = StreamRecompute(x0)                       # x0 [s, b, n*C], the group's input
    with group.saving():                              # every sublayer of the group runs inside
        agg, h_res, h_post, res = hc(x)
        x = group.post_residual_bda(hc, h_res, res, h_post, (y, bias), dropout_p, training)
    group.close()                                     # end of forward for this group

A saved tensor is replaced by a reference when its storage is a state the group produced (a view
of it included); everything else is saved as usual. The rebuilt states are released as soon as
the last reference to them has been unpacked.

In the single-pass form a state is the carrier `[s, b, n*C + k]` (`mhc_core.handoff`: the streams and the
`H_pre` the next sublayer aggregates with): the sublayer reads `residual` as a view of it, and
`post_residual_bda(..., carry=h_pre)` packs the new streams with this sublayer's `H_pre` (kept, `[T, n]`) into
the next state, in forward and in the rebuild alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from mhc_core.handoff import pack

__all__ = ["StreamRecompute"]


@dataclass(frozen=True, kw_only=True)
class _StateRef:
    """A saved view of state `k`: rebuilt by `as_strided` on the recomputed state."""

    k: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


def _key(t: torch.Tensor) -> tuple[torch.device, int]:
    return t.device, t.untyped_storage().data_ptr()


class _RngState:
    """The CPU (and current CUDA device) generator state, to replay a dropout mask."""

    def __init__(self, device: torch.device):
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "mHC recompute with hidden dropout in training cannot run inside a CUDA-graph "
                "capture: replaying the dropout mask needs the CUDA generator's state, which "
                "torch does not give out while capturing; capture without mHC recompute, or "
                "with hidden_dropout=0"
            )
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.device = device

    @contextmanager
    def replay(self) -> Iterator[None]:
        devices = [self.device] if self.cuda is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield


class StreamRecompute:
    """One recompute group (see the module docstring).

    Args:
        anchor: `[s, b, n*C]`, the group's first state; kept (detached, no copy) until the
            group's backward is done.
    """

    def __init__(self, anchor: torch.Tensor):
        self._states: list[torch.Tensor | None] = [anchor.detach()]
        self._steps: list[Callable[[torch.Tensor], torch.Tensor] | None] = [None]
        self._live: dict[tuple[torch.device, int], int] = {}
        self._open = True
        self._refs: list[int] = [0]
        """Saved references to each state not yet unpacked."""

    @property
    def num_states(self) -> int:
        """States produced in this group so far (the anchor not counted)."""
        return len(self._steps) - 1

    def continues_from(self, x: torch.Tensor) -> bool:
        """Whether `x` is this open group's newest state (the next sublayer may extend the group)."""
        return self._open and self._states[-1] is not None and _key(x) == _key(self._states[-1])

    def post_residual_bda(
        self, hc, h_res, residual, h_post, output_with_bias, dropout_p=0.0, training=None, *, carry=None
    ):
        """`hc.post_residual_bda(...)` whose output becomes this group's next state.

        `residual` must be the group's newest state or a view of it (the streams of a carrier; a ValueError
        otherwise: the chain would not rebuild it). Returns `[s, b, n*C]`, the same tensor `hc.post_residual_bda`
        returns; with `carry` (the single-pass `H_pre [s, b, n]`) the carrier `pack(that, carry)`.
        """
        if not self._open:
            raise RuntimeError("StreamRecompute.post_residual_bda: the group is closed")
        if not self.continues_from(residual):
            raise ValueError(
                "StreamRecompute.post_residual_bda: residual is not the group's newest state "
                f"(group of {self.num_states} states); start a new group for it"
            )
        training = hc.training if training is None else training
        y, bias = output_with_bias
        rng = _RngState(y.device) if training and dropout_p > 0 else None
        out = hc.post_residual_bda(h_res, residual, h_post, (y, bias), dropout_p, training)
        if carry is not None:
            out = pack(out, carry)
        saved = (
            h_res.detach(),
            h_post.detach(),
            y.detach(),
            None if bias is None else bias.detach(),
            None if carry is None else carry.detach(),
        )
        newest = self._states[-1]
        assert newest is not None  # continues_from checked it
        view = (
            None
            if residual.shape == newest.shape
            else (
                tuple(residual.size()),
                tuple(residual.stride()),
                residual.storage_offset() - newest.storage_offset(),
            )
        )

        def rebuild(prev: torch.Tensor, saved=saved, rng=rng, view=view) -> torch.Tensor:
            h_res_d, h_post_d, y_d, bias_d, carry_d = saved
            res = prev if view is None else prev.as_strided(view[0], view[1], prev.storage_offset() + view[2])
            with nullcontext() if rng is None else rng.replay():
                new = hc.post_residual_bda(h_res_d, res, h_post_d, (y_d, bias_d), dropout_p, training)
            return new if carry_d is None else pack(new, carry_d)

        whole = out.untyped_storage().nbytes() == out.numel() * out.element_size()
        if out.is_contiguous() and out.storage_offset() == 0 and whole:
            self._live[_key(out)] = len(self._steps)
        self._steps.append(rebuild)
        self._states.append(out.detach())
        self._refs.append(0)
        return out

    @contextmanager
    def saving(self) -> Iterator[StreamRecompute]:
        """Autograd saves made inside drop this group's states (see the module docstring)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self

    def close(self) -> None:
        """End of the group's forward: let go of the states (the anchor stays until backward)."""
        self._open = False
        self._live.clear()
        for k in range(1, len(self._states)):
            self._states[k] = None
        if sum(self._refs) == 0:
            self._release()

    def _pack(self, t: torch.Tensor) -> torch.Tensor | _StateRef:
        k = self._live.get(_key(t)) if self._open else None
        if k is None:
            return t
        self._refs[k] += 1
        return _StateRef(k=k, size=tuple(t.size()), stride=tuple(t.stride()), offset=t.storage_offset())

    def _unpack(self, ref: torch.Tensor | _StateRef) -> torch.Tensor:
        if not isinstance(ref, _StateRef):
            return ref
        state = self._materialize(ref.k)
        self._refs[ref.k] -= 1
        out = state.as_strided(ref.size, ref.stride, ref.offset)
        if sum(self._refs) == 0:
            self._release()
        else:
            self._drop_unneeded()
        return out

    def _materialize(self, k: int) -> torch.Tensor:
        if self._states[0] is None:
            raise RuntimeError("StreamRecompute: state requested after the group was released")
        j = max(i for i in range(k + 1) if self._states[i] is not None)
        with torch.no_grad():
            for i in range(j + 1, k + 1):
                step = self._steps[i]
                assert step is not None, "only state 0, the group's input, has no step"
                self._states[i] = step(self._states[i - 1])
        state = self._states[k]
        assert state is not None  # built above, or already kept
        return state

    def _drop_unneeded(self) -> None:
        """Free each rebuilt state nobody will unpack, unless an unbuilt later state needs it as a step."""
        need = False  # a later state still to be unpacked is unbuilt: the nearest built one below serves it
        for i in range(len(self._states) - 1, 0, -1):
            built = self._states[i] is not None
            if self._refs[i] > 0:
                need = not built
            elif built:
                if not need:
                    self._states[i] = None
                need = False

    def _release(self) -> None:
        """Nothing will be unpacked any more: drop the anchor, the rebuilt states and the closures."""
        self._states = [None] * len(self._states)
        self._steps = [None] * len(self._steps)

"""Check a pipeline split before any process group exists; errors name the numbers.

megatron-core validates the split inside `TransformerConfig` (or with bare asserts deep in
`get_num_layers_to_build`), i.e. on every rank after the process groups are up. A launcher calls
`PipelineSplit(...)` first, so a bad split fails once, in the parent, with a readable message.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PipelineSplit", "parse_layout"]

_LAYOUT_CHARS = {"E": "embedding", "L": "loss", "t": "decoder", "m": "mtp"}


def parse_layout(layout: str | list[list[str]]) -> list[list[str]]:
    """A layout as a flat list of stages (virtual stages in order), each a list of layer kinds.

    Accepts megatron's string form (`"Et|tt|t|tL"`, `|` between stages, `E` embedding, `t`
    decoder, `L` loss, `m` MTP; a repeat count such as `t*3` is expanded) or a list of lists of
    `"embedding" | "decoder" | "loss"` names.
    """
    if isinstance(layout, str):
        stages = []
        for raw in layout.split("|"):
            kinds: list[str] = []
            i = 0
            while i < len(raw):
                ch = raw[i]
                if ch not in _LAYOUT_CHARS:
                    raise ValueError(
                        f"pipeline_model_parallel_layout: unknown layer symbol {ch!r} in {layout!r}"
                    )
                count = 1
                if i + 1 < len(raw) and raw[i + 1] == "*":
                    j = i + 2
                    while j < len(raw) and raw[j].isdigit():
                        j += 1
                    if j == i + 2:
                        raise ValueError(
                            f"pipeline_model_parallel_layout: {ch!r}* without a repeat count in {layout!r}"
                        )
                    count = int(raw[i + 2 : j])
                    i = j
                else:
                    i += 1
                kinds.extend([_LAYOUT_CHARS[ch]] * count)
            stages.append(kinds)
        return stages
    names = set(_LAYOUT_CHARS.values())
    if not isinstance(layout, list | tuple) or not all(isinstance(stage, list | tuple) for stage in layout):
        raise ValueError(
            f"pipeline_model_parallel_layout={layout!r}: expected a string such as 'Et|tt|tL' "
            f"or a list of stages, each a list of {sorted(names)}"
        )
    for k, stage in enumerate(layout):
        unknown = [kind for kind in stage if kind not in names]
        if unknown:
            raise ValueError(
                f"pipeline_model_parallel_layout: stage {k} holds unknown layer kinds {unknown}; "
                f"valid: {sorted(names)}"
            )
    return [list(stage) for stage in layout]


@dataclass(frozen=True, kw_only=True)
class PipelineSplit:
    """A PP (x VPP) split of `num_layers` decoder layers; invalid splits raise `ValueError`."""

    num_layers: int
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    pipeline_model_parallel_layout: str | list[list[str]] | None = None

    def __post_init__(self) -> None:
        pp, vpp, layers = (
            self.pipeline_model_parallel_size,
            self.virtual_pipeline_model_parallel_size,
            self.num_layers,
        )
        for name, v in (
            ("num_layers", layers),
            ("pipeline_model_parallel_size", pp),
            ("virtual_pipeline_model_parallel_size", vpp),
        ):
            if not (v is None and name.startswith("virtual")) and (
                isinstance(v, bool) or not isinstance(v, int)
            ):
                raise ValueError(f"PipelineSplit: {name}={v!r} must be an integer")
        for name in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"PipelineSplit: {name}={getattr(self, name)!r} must be True or False")
        if layers < 1 or pp < 1 or (vpp is not None and vpp < 1):
            raise ValueError(
                f"PipelineSplit: num_layers={layers}, pipeline_model_parallel_size={pp}, "
                f"virtual_pipeline_model_parallel_size={vpp} must all be >= 1"
            )
        if self.pipeline_model_parallel_layout is not None:
            self._check_layout()
            return
        standalone = int(self.account_for_embedding_in_pipeline_split) + int(
            self.account_for_loss_in_pipeline_split
        )
        total = layers + standalone
        if total % pp:
            raise ValueError(
                f"PipelineSplit: num_layers={layers} + {standalone} standalone stage(s) = {total} is not "
                f"divisible by pipeline_model_parallel_size={pp} (remainder {total % pp})"
            )
        per_rank = total // pp
        if vpp is not None and per_rank % vpp:
            raise ValueError(
                f"PipelineSplit: {per_rank} layer slot(s) per pipeline rank ({total} / {pp}) are not divisible by "
                f"virtual_pipeline_model_parallel_size={vpp}"
            )

    def _check_layout(self) -> None:
        if self.account_for_embedding_in_pipeline_split or self.account_for_loss_in_pipeline_split:
            raise ValueError(
                "PipelineSplit: pipeline_model_parallel_layout cannot be combined with "
                "account_for_embedding_in_pipeline_split / account_for_loss_in_pipeline_split"
            )
        stages = parse_layout(self.pipeline_model_parallel_layout)
        pp = self.pipeline_model_parallel_size
        if len(stages) % pp:
            raise ValueError(
                f"PipelineSplit: the layout has {len(stages)} stage(s), not a multiple of "
                f"pipeline_model_parallel_size={pp}"
            )
        vpp = len(stages) // pp
        if self.virtual_pipeline_model_parallel_size not in (None, vpp) and not (
            vpp == 1 and self.virtual_pipeline_model_parallel_size is None
        ):
            raise ValueError(
                f"PipelineSplit: the layout has {len(stages)} stages = {pp} ranks x {vpp} virtual stages, but "
                f"virtual_pipeline_model_parallel_size={self.virtual_pipeline_model_parallel_size}"
            )
        flat = [k for stage in stages for k in stage]
        decoders = flat.count("decoder")
        if decoders != self.num_layers:
            raise ValueError(
                f"PipelineSplit: the layout holds {decoders} decoder layer(s) but num_layers={self.num_layers}"
            )
        if not flat or flat[0] != "embedding" or flat.count("embedding") != 1:
            raise ValueError("PipelineSplit: the layout must start with exactly one embedding ('E')")
        if flat[-1] != "loss" or flat.count("loss") != 1:
            raise ValueError("PipelineSplit: the layout must end with exactly one loss ('L')")

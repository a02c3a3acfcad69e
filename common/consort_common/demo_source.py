"""`demo://NAME[?seed=N]` sources: what a demo name means, for the operator (init containers, local mode)
and the engine image's model cache, which both turn one into `consort demo-model` arguments.

A model's NAME is a size (`tiny`: seconds to write and serve; `bench`: the benchmarks' shape), with
`-bamba` for a hybrid (Mamba2 mixers with attention in every fourth layer) instead of a Llama;
`lora` is a random LoRA adapter for the demo model beside it (adapter sources only).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

SIZES = ("tiny", "bench")
HYBRID_SUFFIX = "-bamba"


@dataclass(frozen=True)
class DemoSource:
    name: str       # tiny, bench, tiny-bamba, bench-bamba or lora
    seed: int

    @property
    def size(self) -> str:
        return self.name.removesuffix(HYBRID_SUFFIX)

    @property
    def arch(self) -> str:
        return "bamba" if self.name.endswith(HYBRID_SUFFIX) else "llama"

    def model_args(self) -> list[str]:
        """`consort demo-model` flags that write this model (not for `lora`, which needs its model's
        directory). A Llama's flags name no --arch (its default), so the init containers of pods written before
        hybrid demos existed stay as they were and the pods do not roll."""
        arch = ["--arch", self.arch] if self.arch != "llama" else []
        return ["--size", self.size, *arch, "--seed", str(self.seed)]


def parse_demo(url: str) -> DemoSource:
    """demo://tiny-bamba?seed=3 -> DemoSource("tiny-bamba", 3). ValueError for a name that is not a demo
    (the CRD's pattern already refuses those for a Specialist)."""
    rest = url.removeprefix("demo://")
    name, _, query = rest.partition("?")
    if name != "lora" and name.removesuffix(HYBRID_SUFFIX) not in SIZES:
        names = [*SIZES, *(s + HYBRID_SUFFIX for s in SIZES)]
        raise ValueError(f"{url!r}: demo models are {', '.join(names)} (and demo://lora for adapters)")
    if query and not re.fullmatch(r"seed=[0-9]{1,9}", query):
        raise ValueError(f"{url!r}: the only query is seed=N (N a non-negative integer of at most 9 digits)")
    return DemoSource(name, int(query.removeprefix("seed=") or 0))


def parse_demo_model(url: str) -> DemoSource:
    """parse_demo for a model source: demo://lora (an adapter) is refused too."""
    demo = parse_demo(url)
    if demo.name == "lora":
        raise ValueError(f"{url!r} is an adapter, not a model")
    return demo

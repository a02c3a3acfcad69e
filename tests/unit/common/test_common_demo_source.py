"""demo:// names: what each means, the `consort demo-model` flags that write it, and the names refused."""
from __future__ import annotations

import pytest

from consort_common.demo_source import SIZES, DemoSource, parse_demo


def test_a_demo_name_is_a_size_and_an_architecture():
    assert parse_demo("demo://tiny") == DemoSource("tiny", 0)
    bench = parse_demo("demo://bench-bamba?seed=7")
    assert (bench.name, bench.size, bench.arch, bench.seed) == ("bench-bamba", "bench", "bamba", 7)
    assert parse_demo("demo://lora?seed=3").seed == 3


def test_a_llamas_flags_name_no_arch_so_existing_pods_keep_their_init_command():
    assert parse_demo("demo://tiny?seed=2").model_args() == ["--size", "tiny", "--seed", "2"]
    assert parse_demo("demo://tiny-bamba?seed=2").model_args() == ["--size", "tiny", "--arch", "bamba", "--seed", "2"]


@pytest.mark.parametrize("url", ["demo://huge", "demo://bamba", "demo://tiny-mamba", "demo://tiny?seed=-1",
                                 "demo://tiny?seed=x", "demo://", "demo://tiny?sed=1",
                                 "demo://tiny?seed=1234567890", "demo://tiny?seed="])
def test_other_names_are_refused(url):
    with pytest.raises(ValueError):
        parse_demo(url)


def test_the_sizes_are_the_demo_models():
    from consort_engine.demo_model import SIZES as SHAPES
    assert set(SIZES) == set(SHAPES)

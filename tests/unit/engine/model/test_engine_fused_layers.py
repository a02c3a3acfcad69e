"""The decoder layers in one C call (models/fused_layers.py, csrc/decoder.c) against the same layers run one
module at a time: the hidden states and every byte of the K/V pool equal, for decode rows, prefill spans
over a cached prefix and both in one step; Llama (GQA), Qwen2 (q/k/v biases) and Qwen3 (per-head q/k norms);
fp32 and bf16 activations, an fp8 pool, int8 and w8a8 weights, rows of two LoRA adapters beside base rows;
a hybrid's (Bamba's) decode steps, its mixers' state pools equal too. And where it must not run: rows beyond
the bf16 kernel's bound (oneDNN's), an adapter the plan lacks, a hybrid's prefill chunks."""
from __future__ import annotations

import pytest
import torch

from consort_engine.config import EngineConfig
from consort_engine.model.cpu_kernels import cpu_kernels
from consort_engine.model.model_runner import ModelRunner
from consort_engine.model.models.fused_layers import FusedLayers
from consort_engine.model.models.packed import BF16_KERNEL_ROWS, has_bf16_dot
from consort_engine.model.step_inputs import RowGroup

VOCAB = 512
BS = 16
LIB = cpu_kernels()
NEEDS_GEMM = pytest.mark.skipif(not hasattr(LIB, "gemm_f32"), reason="the engine's GEMM needs an AVX2 + FMA build")
BF16 = pytest.mark.skipif(not (hasattr(LIB, "gemm_bf16") and has_bf16_dot()),
                          reason="bf16 rows on the engine's GEMM need AVX-512 BF16")
W8A8 = pytest.mark.skipif(not hasattr(LIB, "gemm_i8a8_f32"), reason="the int8 x int8 kernel needs VNNI")


def checkpoint(arch: str, tmp_path_factory) -> str:
    import transformers

    common = dict(hidden_size=256, intermediate_size=320, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, vocab_size=VOCAB, max_position_embeddings=1024,
                  rms_norm_eps=1e-6, initializer_range=0.08, bos_token_id=1, eos_token_id=2)
    cls, cfg = {"llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
                "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config),
                "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config),
                "bamba": (transformers.BambaForCausalLM, transformers.BambaConfig)}[arch]
    if arch == "bamba":            # attention in layer 1 of 4, partial rotary; mixers of 16 heads in 2 groups
        common.update(num_hidden_layers=4, attn_layer_indices=[1], mamba_n_heads=16, mamba_d_head=32,
                      mamba_d_state=32, mamba_n_groups=2, mamba_chunk_size=64)
    torch.manual_seed(11)
    model = cls(cfg(**common)).eval()
    with torch.no_grad():          # biases, norm weights, a mixer's D and dt_bias that matter (transformers: 0 and 1)
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.05)
            elif "norm" in name or name.endswith((".D", ".dt_bias")):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    out = tmp_path_factory.mktemp(arch)
    model.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {arch: checkpoint(arch, tmp_path_factory) for arch in ("llama", "qwen2", "qwen3", "bamba")}


def runner(ckpt: str, dtype: str, **cfg) -> ModelRunner:
    return ModelRunner(EngineConfig(model=ckpt, dtype=dtype, block_size=BS, num_blocks=64, **cfg))


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def forward_both_ways(r: ModelRunner, groups: list[RowGroup]) -> tuple[torch.Tensor, torch.Tensor]:
    """The step through the C plan and through the modules, from the same pools (K/V; a hybrid's conv and SSM
    state and checkpoint rows); each one's hidden states, and their pools after it (asserted equal here)."""
    inp = r.build_inputs(groups)
    model = r.model
    hybrid = r.hybrid_state
    pools = [r.kv_cache] + ([hybrid.conv, hybrid.ssm, hybrid.ckpt_conv, hybrid.ckpt_ssm] if hybrid else [])
    before = [p.clone() for p in pools]
    r.lora_ctx.segments = inp.lora_segments       # as ModelRunner.execute sets them
    try:
        with torch.inference_mode():
            model.fused = False
            plan = model.fused_layers()
            assert isinstance(plan, FusedLayers)
            assert plan.applies(model.embed_tokens(inp.input_ids), inp.meta, inp.lora_segments)
            fused = model(inp.input_ids, inp.positions, inp.meta)
            after = [p.clone() for p in pools]
            for p, b in zip(pools, before):
                p.copy_(b)
            model.fused = None              # the modules, one at a time
            modules = model(inp.input_ids, inp.positions, inp.meta)
    finally:
        r.lora_ctx.segments = []
    for a, p, b in zip(after, pools, before):
        assert torch.equal(a.view(torch.uint8), p.view(torch.uint8))
    for a, b in zip(after[:3], before):       # the step wrote the K/V and state pools
        assert not torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    model.fused = False
    return fused, modules


def steps(r: ModelRunner, adapters: tuple[str | None, ...] = (None, None, None)) -> None:
    """A prefill, then decode rows and a prefill over a cached prefix in one step, then decode alone: each
    the same both ways. The pool carries each step's K/V into the next. adapters: the three sequences'."""
    a, b, c = tokens(70, 1), tokens(40, 2), tokens(9, 3)
    blocks = list(range(0, 8)), list(range(8, 16)), list(range(16, 20))

    def step(*rows: tuple[list[int], int]) -> None:
        groups = [RowGroup(t, start, bl, 1, adapter=name) for (t, start), bl, name in zip(rows, blocks, adapters)]
        fused, modules = forward_both_ways(r, groups)
        assert torch.equal(fused, modules)
        assert fused.abs().sum() > 0 and torch.isfinite(fused).all()
    # three prefill spans; b's first 24 tokens are then in the pool, as a cached prefix would be
    step((a[:69], 0), (b[:24], 0), (c, 0))
    step((a[69:], 69), (b[24:], 24), ([c[3]], 9))
    step(([a[5]], 70), ([b[7]], 40), ([c[1]], 10))


def hybrid_steps(r: ModelRunner, adapters: tuple[str | None, ...] = (None, None, None)) -> None:
    """A hybrid: prefill chunks of three sequences (the first saving its state 16 rows in, the second at its
    end, into checkpoint rows), then a step of a decode row beside two chunks that continue from their slots,
    then a decode step of all three: each the same both ways, the state pools and checkpoint rows included.
    adapters: the three sequences'."""
    seqs = [tokens(37, 1), tokens(20, 2), tokens(9, 3)]
    blocks = list(range(0, 4)), list(range(4, 8)), list(range(8, 10))
    cuts = [(16, 0)], [(17, 1)], []

    def groups(rows: list[tuple[list[int], int]], checkpoints=([], [], [])) -> list[RowGroup]:
        return [RowGroup(t, start, bl, 1, adapter=name, state_slot=slot, checkpoints=list(cut))
                for slot, ((t, start), bl, name, cut) in enumerate(zip(rows, blocks, adapters, checkpoints))]
    a, b, c = seqs
    for rows, checkpoints in (([(a[:17], 0), (b[:17], 0), (c[:7], 0)], cuts),
                              ([(a[17:35], 17), (b[17:18], 17), (c[7:9], 7)], ([], [], [])),
                              ([(a[35:36], 35), (b[18:19], 18), (c[:1], 9)], ([], [], []))):
        fused, modules = forward_both_ways(r, groups(rows, checkpoints))
        assert torch.equal(fused, modules)
        assert fused.abs().sum() > 0 and torch.isfinite(fused).all()


def hybrid_window_step(r: ModelRunner, adapters: tuple[str | None, ...]) -> None:
    """After hybrid_steps: a verify step (a window of 4 rows, one of 3, a decode row) and the commit of 2 and 3
    of the windows' tokens, through the C plan (the commit in its one call) and through the modules (the
    commit mixer by mixer) from the same pools: the hidden states, and the KV and state pools after it."""
    rows = [(tokens(4, 4), 36), (tokens(3, 5), 19), (tokens(1, 6), 10)]        # where hybrid_steps left them
    blocks = list(range(0, 4)), list(range(4, 8)), list(range(8, 10))
    groups = [RowGroup(t, start, bl, len(t), adapter=name, state_slot=slot)
              for slot, ((t, start), bl, name) in enumerate(zip(rows, blocks, adapters))]
    pools = [r.kv_cache, r.conv_state, r.ssm_state]
    before = [p.clone() for p in pools]
    outs, after = [], []
    for fused in (True, False):
        for p, b in zip(pools, before):
            p.copy_(b)
        inp = r.build_inputs(groups)
        assert inp.meta.state.windows is not None and len(inp.meta.state.windows.runs.lengths) == 2
        r.lora_ctx.segments = inp.lora_segments
        try:
            with torch.inference_mode():
                r.model.fused = False if fused else None
                if fused:
                    assert r.model.fused_layers().applies(r.model.embed_tokens(inp.input_ids), inp.meta,
                                                          inp.lora_segments)
                outs.append(r.model(inp.input_ids, inp.positions, inp.meta))
        finally:
            r.lora_ctx.segments = []
        assert (inp.meta.state.windows.commit is not None) == fused      # the commit in one C call, or mixer by mixer
        r.commit_windows({0: 2, 1: 3})
        after.append([p.clone() for p in pools])
    r.model.fused = False
    assert torch.equal(outs[0], outs[1]) and torch.isfinite(outs[0]).all()
    for a, b, start in zip(after[0], after[1], before):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        assert not torch.equal(a.view(torch.uint8), start.view(torch.uint8))


@NEEDS_GEMM
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=BF16)])
def test_fused_layers_equal_the_modules_hybrid(checkpoints, dtype):
    """Bamba's attention (partial rotary) and mixer layers in the one call: decode steps and a verify step
    bit for bit the modules', the KV and both state pools too (after the windows' commit)."""
    r = runner(checkpoints["bamba"], dtype)
    assert r.model.fused_layers().mixers
    hybrid_steps(r)
    hybrid_window_step(r, (None, None, None))


@NEEDS_GEMM
@pytest.mark.parametrize("dtype,quantization", [("float32", "int8"), pytest.param("bfloat16", "none", marks=BF16)])
def test_fused_layers_equal_the_modules_hybrid_with_adapter_rows(checkpoints, tmp_path, dtype, quantization):
    """A hybrid's decode rows of two adapters (a1 on every projection, the mixers' in_proj and out_proj
    included) beside a base row, over int8 weights and in bf16."""
    r = runner(checkpoints["bamba"], dtype, quantization=quantization)
    write_adapters(r, checkpoints["bamba"], tmp_path)
    hybrid_steps(r, ("a1", None, "a2"))
    hybrid_window_step(r, ("a1", "a2", None))


@NEEDS_GEMM
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_fused_layers_equal_the_modules_fp32(checkpoints, arch):
    steps(runner(checkpoints[arch], "float32"))


@NEEDS_GEMM
@pytest.mark.parametrize("kv", ["bfloat16", "fp8"])
def test_fused_layers_equal_the_modules_fp32_over_a_narrower_pool(checkpoints, kv):
    steps(runner(checkpoints["qwen3"], "float32", kv_cache_dtype=kv))


@BF16
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_fused_layers_equal_the_modules_bf16(checkpoints, arch):
    steps(runner(checkpoints[arch], "bfloat16"))


@BF16
def test_fused_layers_equal_the_modules_bf16_over_fp8(checkpoints):
    steps(runner(checkpoints["llama"], "bfloat16", kv_cache_dtype="fp8"))


@NEEDS_GEMM
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=BF16)])
def test_fused_layers_equal_the_modules_int8(checkpoints, dtype):
    steps(runner(checkpoints["qwen2"], dtype, quantization="int8"))


@W8A8
def test_fused_layers_equal_the_modules_w8a8(checkpoints):
    steps(runner(checkpoints["llama"], "float32", quantization="w8a8"))


@BF16
def test_bf16_rows_past_the_kernels_bound_take_the_modules(checkpoints):
    """Beyond BF16_KERNEL_ROWS the bf16 GEMMs are oneDNN's, which C cannot call: the modules run them."""
    r = runner(checkpoints["llama"], "bfloat16")
    inp = r.build_inputs([RowGroup(tokens(BF16_KERNEL_ROWS + 1, 3), 0, list(range(0, 17)), 1)])
    plan = r.model.fused_layers()
    with torch.inference_mode():
        h = r.model.embed_tokens(inp.input_ids)
    assert plan.max_rows == BF16_KERNEL_ROWS and not plan.applies(h, inp.meta)
    assert plan.applies(h[:BF16_KERNEL_ROWS], inp.meta)


def write_adapters(r: ModelRunner, ckpt: str, tmp_path) -> None:
    """Two adapters loaded into the runner: a1 of rank 8 on every projection, a2 of rank 3 on q, v and down."""
    from safetensors.torch import load_file, save_file

    from consort_engine.demo_model import write_demo_adapter

    r.load_adapter("a1", str(write_demo_adapter(ckpt, tmp_path / "a1", rank=8, seed=1)))
    a2 = write_demo_adapter(ckpt, tmp_path / "a2", rank=3, seed=2)
    tensors = load_file(str(a2 / "adapter_model.safetensors"))
    save_file({k: v for k, v in tensors.items() if any(p in k for p in ("q_proj", "v_proj", "down_proj"))},
              str(a2 / "adapter_model.safetensors"))
    r.load_adapter("a2", str(a2))


@NEEDS_GEMM
@pytest.mark.parametrize("dtype,quantization", [("float32", "none"), pytest.param("bfloat16", "none", marks=BF16),
                                                ("float32", "int8")])
@pytest.mark.parametrize("adapters", [("a1", None, "a2"), ("a2", "a2", "a1")], ids=["two-and-base", "two"])
def test_fused_layers_equal_the_modules_with_adapter_rows(checkpoints, tmp_path, dtype, quantization, adapters):
    """Rows of two adapters (one segment each, or two sequences of one adapter in one segment) beside base rows:
    the plan adds each projection's LoRA updates where the modules' Linear adds them, bit for bit (over int8
    weights too: the adapters stay fp32)."""
    r = runner(checkpoints["qwen3"], dtype, quantization=quantization)
    write_adapters(r, checkpoints["qwen3"], tmp_path)
    assert set(r.model.fused_layers().adapters) == {"a1", "a2"}
    steps(r, adapters)
    inp = r.build_inputs([RowGroup(tokens(6, 9), 0, [20], 1, adapter="a1")])
    with torch.inference_mode():
        base = r.model(inp.input_ids, inp.positions, inp.meta)
        r.lora_ctx.segments = inp.lora_segments
        try:
            with_adapter = r.model(inp.input_ids, inp.positions, inp.meta)
        finally:
            r.lora_ctx.segments = []
    assert (with_adapter - base).abs().max() > 0.1         # the updates landed


@NEEDS_GEMM
def test_adapter_rows_of_an_adapter_the_plan_lacks_take_the_modules(checkpoints, monkeypatch):
    """A segment naming an adapter the plan has no table for runs the modules, whose Linear adds what it has
    (nothing); the plan is not called."""
    r = runner(checkpoints["llama"], "float32")
    calls = []
    monkeypatch.setattr(FusedLayers, "run", lambda self, *a: calls.append(1))
    inp = r.build_inputs([RowGroup(tokens(5, 4), 0, [0], 1)])
    r.model.lora_ctx = r.lora_ctx
    r.lora_ctx.segments = [(0, 5, "some-adapter")]
    try:
        with torch.inference_mode():
            out = r.model(inp.input_ids, inp.positions, inp.meta)
    finally:
        r.lora_ctx.segments = []
    assert not calls and out.shape == (5, 256)
    with torch.inference_mode():
        r.model(inp.input_ids, inp.positions, inp.meta)
    assert calls == [1]


def test_no_plan_without_the_engines_kernels(checkpoints, monkeypatch):
    """CONSORT_FUSED_LAYERS=0: the modules, always."""
    monkeypatch.setenv("CONSORT_FUSED_LAYERS", "0")
    r = runner(checkpoints["llama"], "float32")
    assert r.model.fused_layers() is None


@NEEDS_GEMM
def test_mtp_block_layer_in_one_call_equals_its_modules(tmp_path):
    """The MTP block's decode (its one decoder layer and final norm over drafting rows) through the C plan:
    the same bits as through its modules, the block's pool layer included."""
    from consort_engine.demo_model import write_demo_model

    model_dir = write_demo_model(tmp_path / "mtp", max_pos=256, seed=0, mtp="qwen3_next", mtp_seconds=0,
                                 mtp_steps=0, vocab=512)
    r = ModelRunner(EngineConfig(model=str(model_dir), dtype="float32", block_size=BS, num_blocks=64,
                                 speculative="mtp", num_speculative_tokens=2))
    mtp, model = r.model.mtp, r.model
    inp = r.build_inputs([RowGroup([7], 20, list(range(2)), 1), RowGroup([9], 33, list(range(2, 5)), 1)])
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, model.cfg.hidden_size, generator=g)
    before = r.kv_cache.clone()
    with torch.inference_mode():
        mtp.fused = False
        fused = mtp.decode(x.clone(), inp.positions, model.rotary, inp.meta)   # its residual stream, in place
        assert isinstance(mtp.fused, FusedLayers)
        pool = r.kv_cache.clone()
        r.kv_cache.copy_(before)
        mtp.fused = None
        modules = mtp.decode(x.clone(), inp.positions, model.rotary, inp.meta)
    assert torch.equal(fused, modules)
    # bytes, not floats: the pool's unwritten slots hold whatever memory held, NaN patterns included
    assert torch.equal(pool.view(torch.uint8), r.kv_cache.view(torch.uint8))
    assert not torch.equal(pool.view(torch.uint8), before.view(torch.uint8))

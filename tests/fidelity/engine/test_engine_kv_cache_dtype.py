"""A narrower KV pool (`--kv-cache-dtype`) against the model with its own dtype's pool (transformers, fp32)
on held-out text: the quantization harness's model and figures (fidelity_helpers.held_out_case,
quant_fidelity), prompts cut into 48-token chunks so every chunk after the first attends over context
read back from the pool, and greedy continuations decoded over it.

Per (model dtype, pool element) against transformers' fp32 log_softmax: top-1 agreement, max logprob error
on the text's tokens, perplexity delta. The bounds hold with a margin over what this checkpoint measures
(printed with -s); the same engine with its own dtype's pool ("auto") is the harness's check.
"""
from __future__ import annotations

import pytest
from fidelity_helpers import KV_BOUNDS, assert_quant_fidelity, engine_prompt_logprobs, held_out_case, run_engine

from consort_engine.model.cpu_kernels import cpu_kernels


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return held_out_case(tmp_path_factory.mktemp("kvdtype"))


@pytest.mark.parametrize("dtype,kv", list(KV_BOUNDS))
def test_a_narrower_pool_stays_close_to_the_model(case, dtype, kv):
    plps = engine_prompt_logprobs(case.checkpoint, case.prompts, dtype=dtype, kv_cache_dtype=kv,
                                  max_num_batched_tokens=48, enable_prefix_caching=False)
    assert_quant_fidelity(case, plps, kv, name=f"{dtype} model, kv ", bounds=KV_BOUNDS[dtype, kv])


MARGIN = 0.2     # logits between transformers' first two tokens: below it, a pool's rounding may pick either


@pytest.mark.skipif(cpu_kernels() is None, reason="the C kernels need a compiler")
def test_greedy_decoding_over_an_fp8_pool_matches_the_reference_where_it_is_sure(case):
    """Decode steps read the fp8 pool through the decode kernel: each greedy token the engine picks over
    it is transformers' top-1 wherever transformers' margin between its first two tokens is clear."""
    import torch
    from fidelity_helpers import hf_model

    from consort_engine.kv.sequence import SamplingParams, Sequence

    seqs = [Sequence(p[:64], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
            for p in case.prompts]
    engine = run_engine(case.checkpoint, seqs, dtype="float32", kv_cache_dtype="fp8")
    assert engine.runner.kv_cache.dtype == torch.float8_e4m3fn
    hf = hf_model(case.checkpoint)
    sure = agree = total = agree_all = 0
    for s in seqs:
        with torch.no_grad():
            logits = hf(torch.tensor([s.token_ids])).logits[0, 63:-1].float()
        top2 = logits.topk(2, -1)
        clear = (top2.values[:, 0] - top2.values[:, 1]) > MARGIN
        same = top2.indices[:, 0] == torch.tensor(s.output_token_ids)
        sure, agree = sure + int(clear.sum()), agree + int(same[clear].sum())
        total, agree_all = total + len(same), agree_all + int(same.sum())
    print(f"\nfp8 pool, greedy: {agree}/{sure} positions with a margin over {MARGIN} and {agree_all}/{total} "
          "in all agree with transformers")
    assert sure >= 40 and agree / sure >= 0.97 and agree_all / total >= 0.85
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks   # nothing leaked

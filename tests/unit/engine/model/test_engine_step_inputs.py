"""ModelRunner.build_inputs: a step's flat inputs from its sequences' rows, checked token by token against
the definitions (a row's position, its pool slot through the block table, the groups' order and offsets)
on a step with decode rows, a verify window, a prefill from the start and one over a cached prefix, rows
crossing block boundaries and block tables of different lengths."""
from __future__ import annotations

import random

import pytest
import torch

from consort_engine.config import EngineConfig
from consort_engine.model.model_runner import ModelRunner
from consort_engine.model.step_inputs import RowGroup

BS = 4


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny")
    transformers.LlamaForCausalLM(cfg).save_pretrained(out)
    return ModelRunner(EngineConfig(model=str(out), dtype="float32", block_size=BS, num_blocks=128))


def test_step_inputs_follow_their_definitions(runner):
    rng = random.Random(3)
    free = list(range(1, 100))
    rng.shuffle(free)

    def group(n: int, start: int, sampled: int) -> RowGroup:
        blocks = [free.pop() for _ in range(-(-(start + n) // BS) + rng.randrange(0, 3))]   # spare blocks past it
        return RowGroup([rng.randrange(3, 128) for _ in range(n)], start, blocks, sampled)

    long = runner.max_kernel_query + 5
    groups = [group(long, 0, 1), group(1, 9, 1), group(long, 6, 1), group(4, 11, 4), group(1, 3, 1),
              group(7, 0, 0)]
    batched = [i for i, g in enumerate(groups) if len(g.tokens) <= runner.max_kernel_query]
    order = batched + [i for i in range(len(groups)) if i not in batched]
    inp = runner.build_inputs(groups)
    meta = inp.meta
    assert inp.order == order

    tokens, positions, slots, cu = [], [], [], [0]
    for i in order:
        g = groups[i]
        for j, token in enumerate(g.tokens):
            p = g.start + j
            tokens.append(token)
            positions.append(p)
            slots.append(g.block_table[p // BS] * BS + p % BS)
        cu.append(cu[-1] + len(g.tokens))
    assert inp.input_ids.tolist() == tokens and inp.input_ids.dtype == torch.int64
    assert inp.positions.tolist() == positions and inp.positions.dtype == torch.int64
    assert meta.slot_mapping.tolist() == slots and meta.slot_mapping.dtype == torch.int64
    assert inp.item_rows == [(cu[order.index(i)], cu[order.index(i) + 1]) for i in range(len(groups))]
    sampled = []
    for i, g in enumerate(groups):
        end = inp.item_rows[i][1]
        sampled += range(end - g.num_sampled, end)
    assert inp.sample_idx.tolist() == sampled

    nb = len(batched)
    context = [groups[i].start + len(groups[i].tokens) for i in order]
    width = max(-(-c // BS) for c in context)
    tables = [groups[i].block_table[:-(-c // BS)] for i, c in zip(order, context)]
    padded = [t + [0] * (width - len(t)) for t in tables]
    assert meta.num_batched_tokens == cu[nb]
    assert meta.block_tables.tolist() == padded[:nb] and meta.block_tables.dtype == torch.int32
    assert meta.context_lens.tolist() == context[:nb] and meta.context_lens.dtype == torch.int32
    assert meta.cu_query_lens.tolist() == cu[:nb + 1] and meta.cu_query_lens.dtype == torch.int32
    assert meta.max_context_len == max(context[:nb])
    assert meta.max_query_len == max(len(groups[i].tokens) for i in batched)
    assert meta.prefill_block_tables.tolist() == padded[nb:]
    assert meta.prefill_context_lens.tolist() == context[nb:]
    assert meta.prefill_cu_query_lens.tolist() == [c - cu[nb] for c in cu[nb:]]
    spans = [(p.start, p.end, p.cached, p.context_len) for p in meta.prefills]
    assert spans == [(cu[r], cu[r + 1], groups[order[r]].start, context[r]) for r in range(nb, len(order))]
    for span, r in zip(meta.prefills, range(nb, len(order))):
        if span.cached:
            assert span.block_ids.tolist() == tables[r] and span.block_ids.dtype == torch.int64
        else:
            assert span.block_ids is None

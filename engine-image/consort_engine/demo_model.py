"""`consort demo-model OUT`: a small Llama-family or Bamba (hybrid) checkpoint + BPE tokenizer that transformers loads.

The tokenizer is a byte-level BPE trained (deterministically, in seconds) on the libstdc++ headers
under /usr/include/c++; weights are random (seeded) unless --train fits the model on the same text
for a few minutes on the CPU. --mtp adds a multi-token-prediction block (models/mtp.py) distilled
from the model's own greedy choices, so MTP drafting has something to accept.
"""
from __future__ import annotations

import argparse
import errno
import json
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from consort_common.help import HelpFormatter
from consort_engine.config import checkpoint_dir

ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
         "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM", "bamba": "BambaForCausalLM"}
SPECIAL = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CPP_ROOT = Path("/usr/include/c++")


@dataclass(frozen=True)
class Size:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    max_pos: int = 2048


SIZES = {"tiny": Size(256, 4, 4, 2, 688, 4096), "bench": Size(512, 8, 8, 4, 1408, 32000)}


def cpp_files(root: Path = CPP_ROOT) -> list[Path]:
    """The corpus: every regular file under the libstdc++ include tree, in a fixed order."""
    files = sorted(p for p in root.rglob("*") if p.is_file())
    if not files:   # with the path as filename: `consort` prints it as one line
        raise FileNotFoundError(errno.ENOENT, "no C++ headers here: the demo tokenizer is trained on them "
                                "(install g++ or libstdc++-dev)", str(root))
    return files


def cpp_text(limit_bytes: int | None = None) -> list[str]:
    texts, total = [], 0
    for f in cpp_files():
        t = f.read_text(errors="replace")
        texts.append(t)
        total += len(t)
        if limit_bytes and total >= limit_bytes:
            break
    return texts


def train_tokenizer(vocab_size: int, limit_bytes: int | None = None):
    """Byte-level BPE over the C++ corpus; the special tokens take the first ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(cpp_text(limit_bytes), trainer=trainer)
    return tok


def hf_config(arch: str, s: Size, *, tie: bool, bos: int, eos: list[int]) -> dict:
    cfg = {
        "architectures": [ARCHS[arch]], "model_type": arch,
        "hidden_size": s.hidden, "intermediate_size": s.ffn, "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads, "head_dim": s.hidden // s.heads,
        "vocab_size": s.vocab, "max_position_embeddings": s.max_pos, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": tie,
        "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": "float32", "initializer_range": 0.02,
    }
    if arch in ("llama", "qwen3"):
        cfg["attention_bias"] = False
    if arch == "llama":
        cfg["mlp_bias"] = False
    if arch in ("qwen2", "qwen3"):
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=s.layers)
    if arch == "mistral":
        cfg["sliding_window"] = None
    return cfg


def bamba_checkpoint(s: Size, *, tie: bool, bos: int, eos: list[int],
                     seed: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """config.json's fields and random weights (transformers' own initialisation: the mixers' A, dt and D
    as a Mamba2 starts) of a Bamba: attention in every fourth layer (at least the last), Mamba2 mixers of
    hidden / 16 heads x 32 elsewhere, d_state 64, one group."""
    import transformers

    attn = [i for i in range(s.layers) if i % 4 == 3] or [s.layers - 1]
    hf = transformers.BambaConfig(
        hidden_size=s.hidden, intermediate_size=s.ffn, num_hidden_layers=s.layers, num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads, vocab_size=s.vocab, max_position_embeddings=s.max_pos, rms_norm_eps=1e-6,
        tie_word_embeddings=tie, bos_token_id=bos, eos_token_id=eos, initializer_range=0.02,
        attn_layer_indices=attn, mamba_n_heads=s.hidden // 16, mamba_d_head=32, mamba_d_state=64,
        mamba_n_groups=1, mamba_chunk_size=64)
    torch.manual_seed(seed)
    weights = {k: v.detach().clone() for k, v in transformers.BambaForCausalLM(hf).state_dict().items()}
    if tie:
        weights.pop("lm_head.weight", None)
    cfg = hf.to_dict() | {"architectures": [ARCHS["bamba"]], "torch_dtype": "float32"}
    cfg.pop("dtype", None)
    return cfg, weights


def random_weights(arch: str, s: Size, *, tie: bool, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    d = s.hidden // s.heads
    w = {"model.embed_tokens.weight": normal(s.vocab, s.hidden), "model.norm.weight": torch.ones(s.hidden)}
    for i in range(s.layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = normal(s.heads * d, s.hidden)
        w[p + "self_attn.k_proj.weight"] = normal(s.kv_heads * d, s.hidden)
        w[p + "self_attn.v_proj.weight"] = normal(s.kv_heads * d, s.hidden)
        w[p + "self_attn.o_proj.weight"] = normal(s.hidden, s.heads * d)
        if arch == "qwen2":
            w[p + "self_attn.q_proj.bias"] = normal(s.heads * d)
            w[p + "self_attn.k_proj.bias"] = normal(s.kv_heads * d)
            w[p + "self_attn.v_proj.bias"] = normal(s.kv_heads * d)
        if arch == "qwen3":
            w[p + "self_attn.q_norm.weight"] = torch.ones(d)
            w[p + "self_attn.k_norm.weight"] = torch.ones(d)
        w[p + "mlp.gate_proj.weight"] = normal(s.ffn, s.hidden)
        w[p + "mlp.up_proj.weight"] = normal(s.ffn, s.hidden)
        w[p + "mlp.down_proj.weight"] = normal(s.hidden, s.ffn)
        w[p + "input_layernorm.weight"] = torch.ones(s.hidden)
        w[p + "post_attention_layernorm.weight"] = torch.ones(s.hidden)
    if not tie:
        w["lm_head.weight"] = normal(s.vocab, s.hidden)
    return w


def write_tokenizer(out: Path, tok, max_pos: int) -> None:
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "pad_token": "</s>", "add_bos_token": False, "add_eos_token": False,
        "model_max_length": max_pos, "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE,
    }, indent=2))


def write_demo_model(out_dir: str | Path, *, arch: str = "llama", hidden: int = 256, layers: int = 4,
                     heads: int = 4, kv_heads: int = 2, ffn: int = 688, vocab: int = 4096,
                     max_pos: int = 2048, seed: int = 0, tie: bool = False, train: bool = False,
                     train_seconds: float = 300.0, tokenizer=None, mtp: str | None = None,
                     mtp_seconds: float = 120.0, mtp_steps: int | None = None) -> Path:
    """Writes config.json, generation_config.json, model.safetensors, tokenizer.json and
    tokenizer_config.json (with a chat template) into out_dir and returns it. mtp: None, or the MTP
    block's tensor layout ("qwen3_next" or "deepseek_v3"), trained for mtp_seconds."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)}")
    if mtp and arch == "bamba":
        raise ValueError("--mtp is not available with --arch bamba (the block is fitted from a Llama-family layer)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    s = Size(hidden, layers, heads, kv_heads, ffn, vocab, max_pos)
    tok = tokenizer or train_tokenizer(vocab, limit_bytes=None if vocab > 8192 else 4_000_000)
    if tok.get_vocab_size() > vocab:
        raise ValueError(f"tokenizer has {tok.get_vocab_size()} tokens > vocab {vocab}")
    bos, eos, end = tok.token_to_id("<s>"), tok.token_to_id("</s>"), tok.token_to_id("<|end|>")
    if arch == "bamba":
        cfg, weights = bamba_checkpoint(s, tie=tie, bos=bos, eos=[eos, end], seed=seed)
    else:
        cfg = hf_config(arch, s, tie=tie, bos=bos, eos=[eos, end])
        weights = random_weights(arch, s, tie=tie, seed=seed)
    if train:
        weights = train_weights(cfg, weights, tok, seconds=train_seconds, seed=seed)
    if mtp:
        cfg["num_nextn_predict_layers"] = 1
        weights.update(mtp_tensors(train_mtp(cfg, weights, tok, seconds=mtp_seconds, seed=seed,
                                                 max_steps=mtp_steps), mtp, layers))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": bos, "eos_token_id": [eos, end], "do_sample": False}, indent=2))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    write_tokenizer(out, tok, max_pos)
    return out


def train_weights(cfg: dict, weights: dict[str, torch.Tensor], tok, *, seconds: float, seed: int,
                  seq_len: int = 256, batch: int = 8, lr: float = 2e-3) -> dict[str, torch.Tensor]:
    """Next-token training on the C++ corpus with transformers' reference model, for `seconds`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    hf_cfg = AutoConfig.for_model(**cfg)
    model = AutoModelForCausalLM.from_config(hf_cfg)
    model.load_state_dict(weights, strict=False)
    if cfg["tie_word_embeddings"]:
        model.tie_weights()
    eos = tok.token_to_id("</s>")
    ids: list[int] = []
    for text in cpp_text(limit_bytes=6_000_000):
        ids += tok.encode(text).ids + [eos]
    data = torch.tensor(ids, dtype=torch.long)
    n_windows = (len(data) - 1) // seq_len
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(seed)
    model.train()
    start, step, loss_ema = time.monotonic(), 0, None
    while time.monotonic() - start < seconds:
        frac = (time.monotonic() - start) / seconds
        for group in opt.param_groups:       # warm-up then cosine decay over the time budget
            group["lr"] = lr * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        idx = torch.randint(0, n_windows, (batch,), generator=g) * seq_len
        x = torch.stack([data[i:i + seq_len] for i in idx.tolist()])
        loss = model(input_ids=x, labels=x, use_cache=False).loss     # transformers shifts the labels
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_ema = loss.item() if loss_ema is None else 0.95 * loss_ema + 0.05 * loss.item()
        step += 1
        if step % 20 == 0:
            print(f"train step {step} loss {loss_ema:.3f} ({time.monotonic() - start:.0f}s)", flush=True)
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if "rotary_emb" not in k}
    if cfg["tie_word_embeddings"]:
        state.pop("lm_head.weight", None)
    return state


def hf_decoder_modules(model_type: str) -> tuple[Callable[..., torch.nn.Module], type]:
    """transformers' decoder layer (a callable of (config, layer_idx)) and RMSNorm class of an --arch or a
    Bamba: an MTP block's layer is its base model's own attention layer (Qwen3's has q/k norms, Qwen2's
    q/k/v biases, a Bamba's partial rotary), as the engine's MTPBlock builds it."""
    import functools
    import importlib

    if model_type == "bamba":
        from transformers.models.bamba import modeling_bamba as m
        return functools.partial(m.BambaDecoderLayer, layer_type="full_attention"), m.BambaRMSNorm
    if model_type not in ARCHS:
        raise ValueError(f"no MTP reference for model_type {model_type!r} (one of {sorted(ARCHS)} or bamba)")
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    prefix = ARCHS[model_type].removesuffix("ForCausalLM")
    return getattr(module, prefix + "DecoderLayer"), getattr(module, prefix + "RMSNorm")


class MTPReference(torch.nn.Module):
    """The MTP block on transformers' modules of the config's architecture, Qwen3-Next parameter names
    (the reference the engine's models/mtp.py is checked against, and what train_mtp fits)."""

    def __init__(self, hf_cfg):
        super().__init__()
        decoder_layer, rms_norm = hf_decoder_modules(hf_cfg.model_type)
        h, eps = hf_cfg.hidden_size, hf_cfg.rms_norm_eps
        self.pre_fc_norm_embedding = rms_norm(h, eps)
        self.pre_fc_norm_hidden = rms_norm(h, eps)
        self.fc = torch.nn.Linear(2 * h, h, bias=False)
        self.layers = torch.nn.ModuleList([decoder_layer(hf_cfg, layer_idx=0)])
        self.norm = rms_norm(h, eps)

    def forward(self, e: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, rotary) -> torch.Tensor:
        """e: embeddings of tokens p+1, hidden: final-norm states at p [B, T, H], pos: p [T] -> [B, T, H]."""
        x = self.fc(torch.cat((self.pre_fc_norm_embedding(e), self.pre_fc_norm_hidden(hidden)), -1))
        pe = rotary(x, pos[None].expand(x.shape[0], -1))
        out = self.layers[0](x, position_embeddings=pe, position_ids=pos[None])
        return self.norm(out[0] if isinstance(out, tuple) else out)      # Bamba's layer: (h, attention weights)


def mtp_reference_drafts(model_dir: str | Path, context: list[int], k: int) -> list[int]:
    """k chained MTP drafts after `context`, recomputing the whole sequence with transformers' modules
    (the model and MTPReference; the block read from either layout): what the engine's drafter must
    propose for that context."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    block = MTPReference(AutoConfig.from_pretrained(model_dir)).eval()     # decodes config.json's Infinity
    # checkpoint name (either layout) -> the block's Qwen3-Next name: mtp_tensors renames the names too
    names = [f"mtp.{n}" for n in block.state_dict()]
    mtp_name = {n: n for n in names} | mtp_tensors(dict(zip(names, names)), "deepseek_v3", cfg["num_hidden_layers"])
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        state = {mtp_name[n][4:]: f.get_tensor(n) for n in f.keys() if n in mtp_name}
    block.load_state_dict(state)
    embed, head, rotary = model.model.embed_tokens, model.get_output_embeddings(), model.model.rotary_emb
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([context[:-1]])).last_hidden_state   # positions 0..L-2
        tokens, drafts = list(context[1:]), []
        for _ in range(k):
            out = block(embed(torch.tensor([tokens])), hidden, torch.arange(len(tokens)), rotary)
            drafts.append(int(head(out[:, -1]).argmax(-1)))
            tokens.append(drafts[-1])
            hidden = torch.cat((hidden, out[:, -1:]), dim=1)
    return drafts


def train_mtp(cfg: dict, weights: dict[str, torch.Tensor], tok, *, seconds: float, seed: int,
              seq_len: int = 64, batch: int = 16, lr: float = 3e-3, depth: int = 2,
              max_steps: int | None = None) -> dict[str, torch.Tensor]:
    """An MTP block (Qwen3-Next names, `mtp.` prefix) fitted for `seconds` on the frozen model:
    row p fuses embed(t[p+1]) with the model's final-norm hidden state at p, and its label is the
    model's own greedy choice after t[p+1] (what verification accepts). Every other batch continues
    a corpus prefix with the model's own greedy tokens: the text it drafts for when serving. Depth 2 chains the block's
    output as the next row's hidden state, as drafting does."""
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(seed)
    hf_cfg = AutoConfig.for_model(**cfg)
    hf_cfg._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(hf_cfg)
    model.load_state_dict(weights, strict=False)
    if cfg["tie_word_embeddings"]:
        model.tie_weights()
    model.eval().requires_grad_(False)
    block = MTPReference(hf_cfg)
    last = f"model.layers.{cfg['num_hidden_layers'] - 1}."          # start from the last decoder layer
    block.layers[0].load_state_dict({k[len(last):]: v for k, v in weights.items() if k.startswith(last)})
    rotary, embed, head = model.model.rotary_emb, model.model.embed_tokens, model.get_output_embeddings()

    def run(e: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return block(e, hidden, pos, rotary)

    eos = tok.token_to_id("</s>")
    ids: list[int] = []
    for text in cpp_text(limit_bytes=2_000_000):
        ids += tok.encode(text).ids + [eos]
    data = torch.tensor(ids, dtype=torch.long)
    n_windows = (len(data) - 1) // seq_len
    opt = torch.optim.AdamW(block.parameters(), lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed + 1)
    start, step, acc_ema = time.monotonic(), 0, None
    while time.monotonic() - start < seconds and (max_steps is None or step < max_steps):
        idx = torch.randint(0, n_windows, (batch,), generator=g) * seq_len
        x = torch.stack([data[i:i + seq_len] for i in idx.tolist()])
        with torch.no_grad():
            if step % 2:      # every other batch: corpus prefix + the model's own greedy continuation,
                half = seq_len // 2     # the text drafting actually sees (a small model's loops included)
                x = model.generate(input_ids=x[:, :half], attention_mask=torch.ones_like(x[:, :half]),
                                   max_new_tokens=seq_len - half, min_new_tokens=seq_len - half,
                                   do_sample=False, pad_token_id=eos)[:, :seq_len]
            out = model.model(input_ids=x, use_cache=False).last_hidden_state      # after the final norm
            greedy = head(out).argmax(-1)                   # greedy[:, q]: the model's token after t[q]
        hidden, loss, pos = out, 0.0, torch.arange(seq_len)
        for d in range(1, depth + 1):
            # rows p = d-1 .. T-2: token t[p+1], the previous depth's output for row p-1 (the model's own
            # hidden state at p for depth 1); label: the model's greedy token after t[p+1], greedy[:, p+1]
            e = embed(x[:, d:])
            hidden = run(e, hidden[:, : seq_len - d], pos[d - 1: seq_len - 1])
            logits = head(hidden)
            labels = greedy[:, d:]
            ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
            # + regression onto the model's own hidden state one position on (EAGLE's feature loss):
            # a dense signal that converges in CPU minutes where the token loss alone does not
            feat = torch.nn.functional.smooth_l1_loss(hidden, out[:, d:])
            loss = loss + (ce + 10.0 * feat) / d
            if d == 1:
                acc = (logits.argmax(-1) == labels).float().mean().item()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        acc_ema = acc if acc_ema is None else 0.9 * acc_ema + 0.1 * acc
        step += 1
        if step % 10 == 0:
            print(f"mtp step {step} loss {loss.item():.3f} top-1 agreement {acc_ema:.2f} "
                  f"({time.monotonic() - start:.0f}s)", flush=True)
    return {f"mtp.{k}": v.detach().clone() for k, v in block.state_dict().items()}


def mtp_tensors(state: dict[str, torch.Tensor], layout: str, num_hidden_layers: int) -> dict[str, torch.Tensor]:
    """Qwen3-Next-named MTP tensors (`mtp.*`) as the checkpoint layout asks: qwen3_next or deepseek_v3
    (`model.layers.{num_hidden_layers}.*` with eh_proj / enorm / hnorm / shared_head.norm)."""
    if layout == "qwen3_next":
        return dict(state)
    if layout != "deepseek_v3":
        raise ValueError(f"unknown MTP layout {layout!r}: qwen3_next or deepseek_v3")
    names = {"mtp.fc.": "eh_proj.", "mtp.pre_fc_norm_embedding.": "enorm.", "mtp.pre_fc_norm_hidden.": "hnorm.",
             "mtp.norm.": "shared_head.norm.", "mtp.layers.0.": ""}
    out = {}
    for k, v in state.items():
        src = next(s for s in names if k.startswith(s))
        out[f"model.layers.{num_hidden_layers}.{names[src]}{k[len(src):]}"] = v
    return out


# the projections a demo adapter targets, in the order its random draws go (layer by layer)
ADAPTER_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "out_proj", "gate_proj", "up_proj",
                       "down_proj")


def projection_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection ADAPTER_PROJECTIONS names, from config.json (a hybrid's mixer in_proj /
    out_proj as models/mamba2.py sizes them)."""
    h, f = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (f, h),
              "up_proj": (f, h), "down_proj": (h, f)}
    if "mamba_n_heads" in cfg:
        inner = int(cfg.get("mamba_expand", 2)) * h
        conv = inner + 2 * int(cfg.get("mamba_n_groups", 1)) * int(cfg.get("mamba_d_state", 256))
        shapes |= {"in_proj": (inner + conv + int(cfg["mamba_n_heads"]), h), "out_proj": (h, inner)}
    return shapes


def write_demo_adapter(model_dir: str | Path, out: str | Path, rank: int = 4, seed: int = 0) -> Path:
    """A random PEFT LoRA adapter on every attention, mixer (a hybrid's in_proj / out_proj) and MLP projection
    of a checkpoint: which layer has which from its safetensors' names (any weight format), their shapes from
    config.json (demos and tests of adapter rollout: `demo://lora?seed=N` sources)."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    shapes = projection_shapes(json.loads((model_dir / "config.json").read_text()))
    key = re.compile(r"model\.(layers\.(\d+)\.(?:self_attn|mlp|feed_forward|mamba)\.(\w+_proj))\.\w+")
    found = set()
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                m = key.fullmatch(name)
                if m and m.group(3) in shapes:
                    found.add(((int(m.group(2)), ADAPTER_PROJECTIONS.index(m.group(3))), m.group(1), m.group(3)))
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for _, name, proj in sorted(found):
        o, n = shapes[proj]
        tensors[f"base_model.model.model.{name}.lora_A.weight"] = torch.randn(rank, n, generator=g) * 0.5
        tensors[f"base_model.model.model.{name}.lora_B.weight"] = torch.randn(o, rank, generator=g) * 0.5
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="consort demo-model", description=__doc__.splitlines()[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("out", help="directory to write (created)")
    ap.add_argument("--lora-for", metavar="MODEL_DIR", type=checkpoint_dir,
                    help="write a random LoRA adapter for this checkpoint instead of a model")
    ap.add_argument("--rank", type=int, default=4, help="LoRA rank (with --lora-for)")
    ap.add_argument("--arch", choices=sorted(ARCHS), default="llama", help="the checkpoint's architecture")
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny",
                    help="tiny: seconds to write and serve; bench: the benchmarks' larger shape")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    ap.add_argument("--tie", action="store_true", help="tie the LM head to the embedding")
    ap.add_argument("--train", action="store_true", help="fit the model on the C++ corpus (CPU, minutes)")
    ap.add_argument("--train-seconds", type=float, default=300.0, help="with --train: how long to fit")
    ap.add_argument("--mtp", nargs="?", const="qwen3_next", choices=["qwen3_next", "deepseek_v3"],
                    help="add a multi-token-prediction block (tensor layout; qwen3_next without a value), "
                         "distilled from the model on the CPU for --mtp-seconds")
    ap.add_argument("--mtp-seconds", type=float, default=120.0, help="with --mtp: how long to distil")
    a = ap.parse_args(argv)
    if a.lora_for:
        print(write_demo_adapter(a.lora_for, a.out, rank=a.rank, seed=a.seed))
        return 0
    s = SIZES[a.size]
    out = write_demo_model(a.out, arch=a.arch, hidden=s.hidden, layers=s.layers, heads=s.heads,
                           kv_heads=s.kv_heads, ffn=s.ffn, vocab=s.vocab, max_pos=s.max_pos, seed=a.seed,
                           tie=a.tie, train=a.train, train_seconds=a.train_seconds, mtp=a.mtp,
                           mtp_seconds=a.mtp_seconds)
    print(out)
    return 0

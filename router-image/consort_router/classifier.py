"""The classifier: a distribution over specialists plus a reject class.

Built-in: multinomial naive Bayes over hashed word unigrams and bigrams (plus C++ punctuation tokens),
trained at start-up from labeled examples in milliseconds, pure Python. Features are hashed with
Python's `hash`, so a trained model is only valid in the process that trained it (it is never saved:
it is retrained from the examples on every start and config reload).

User model: a TorchScript module `forward(texts: list[str]) -> Tensor[batch, n_labels]` of logits,
loaded with torch only when configured.
"""
from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from .config import ClassifierConfig, LabeledExample

log = logging.getLogger("consort.router.classifier")
TOKEN_RE = re.compile(r"[a-z_][a-z0-9_]*|\d+|::|->|<<|>>|[{}()<>\[\];#*&=]")
TEXT_LIMIT = 16 * 1024  # characters a prediction looks at


class Classifier(Protocol):
    labels: tuple[str, ...]

    def predict(self, text: str) -> dict[str, float]:
        """Probability per label (specialist names and the reject label); sums to 1."""
        ...


def features(text: str, dim: int) -> dict[int, int]:
    toks = TOKEN_RE.findall(text[:TEXT_LIMIT].lower())
    out: dict[int, int] = {}
    prev = None
    for t in toks:
        h = hash(t) % dim
        out[h] = out.get(h, 0) + 1
        if prev is not None:
            b = hash((prev, t)) % dim
            out[b] = out.get(b, 0) + 1
        prev = t
    return out


@dataclass(frozen=True)
class NaiveBayes:
    labels: tuple[str, ...]
    log_prior: tuple[float, ...]
    loglik: dict[int, tuple[float, ...]]  # feature -> per-label log P(f | label), seen features only
    unseen: tuple[float, ...]             # per-label log P(f | label) of a feature never seen in training
    dim: int
    evidence_cap: float

    def logits(self, text: str) -> list[float]:
        feats = features(text, self.dim)
        n = sum(feats.values())
        k = len(self.labels)
        acc = [0.0] * k
        for f, c in feats.items():
            ll = self.loglik.get(f, self.unseen)
            for i in range(k):
                acc[i] += c * ll[i]
        scale = min(1.0, self.evidence_cap / n) if n else 0.0
        return [self.log_prior[i] + scale * acc[i] for i in range(k)]

    def predict(self, text: str) -> dict[str, float]:
        return softmax(self.labels, self.logits(text))


def softmax(labels: tuple[str, ...], logits: list[float]) -> dict[str, float]:
    m = max(logits)
    ex = [math.exp(x - m) for x in logits]
    z = sum(ex)
    return {lab: e / z for lab, e in zip(labels, ex)}


def train_naive_bayes(
    examples: list[LabeledExample], dim: int = 1 << 18, alpha: float = 0.1, evidence_cap: float = 4.0
) -> NaiveBayes:
    if not examples:
        raise ValueError("the classifier needs at least one labeled example")
    labels = tuple(sorted({e.label for e in examples}))
    idx = {lab: i for i, lab in enumerate(labels)}
    k = len(labels)
    doc_counts = [0] * k
    totals = [0] * k
    counts: dict[int, list[int]] = {}
    for e in examples:
        i = idx[e.label]
        doc_counts[i] += 1
        for f, c in features(e.text, dim).items():
            counts.setdefault(f, [0] * k)[i] += c
            totals[i] += c
    vocab = max(len(counts), 1)
    denom = [math.log(totals[i] + alpha * vocab) for i in range(k)]
    unseen = tuple(math.log(alpha) - denom[i] for i in range(k))
    loglik = {f: tuple(math.log(cs[i] + alpha) - denom[i] for i in range(k)) for f, cs in counts.items()}
    n_docs = sum(doc_counts)
    log_prior = tuple(math.log(doc_counts[i] / n_docs) for i in range(k))
    return NaiveBayes(labels, log_prior, loglik, unseen, dim, evidence_cap)


@dataclass
class TorchClassifier:
    labels: tuple[str, ...]
    module: object

    def predict(self, text: str) -> dict[str, float]:
        import torch  # only when a torch classifier is configured

        with torch.no_grad():
            logits = self.module([text[:TEXT_LIMIT]])  # type: ignore[operator]
        return softmax(self.labels, [float(x) for x in logits[0].tolist()])


def load_examples(path: str | Path) -> list[LabeledExample]:
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            out.append(LabeledExample.model_validate(json.loads(line)))
        except Exception as e:  # noqa: BLE001 - report the line
            raise ValueError(f"{path}:{n}: bad example: {e}") from e
    return out


def build_classifier(cfg: ClassifierConfig, specialists: set[str], base_dir: Path) -> Classifier | None:
    """Train (builtin) or load (torch) the configured classifier; None when kind=none."""
    if cfg.kind == "none":
        return None
    allowed = specialists | {cfg.reject_label}
    if cfg.kind == "torch":
        if not cfg.torch_model_path or not cfg.torch_labels:
            raise ValueError("classifier kind=torch needs torch_model_path and torch_labels")
        bad = set(cfg.torch_labels) - allowed
        if bad:
            raise ValueError(f"classifier labels {sorted(bad)} are neither specialists nor the reject label")
        import torch

        module = torch.jit.load(str(resolve(base_dir, cfg.torch_model_path)), map_location="cpu")
        module.eval()
        return TorchClassifier(tuple(cfg.torch_labels), module)
    examples = list(cfg.examples)
    if cfg.examples_path:
        examples += load_examples(resolve(base_dir, cfg.examples_path))
    if not examples:
        return None
    unknown = {e.label for e in examples} - allowed
    if unknown:  # a shared labeled set may cover more specialists than this ensemble has
        log.warning("classifier: ignoring examples labelled %s (not specialists of this ensemble)", sorted(unknown))
        examples = [e for e in examples if e.label in allowed]
    if not {e.label for e in examples} - {cfg.reject_label}:
        raise ValueError(f"no classifier example is labelled with a specialist of this ensemble "
                         f"(unknown labels: {sorted(unknown)})")
    return train_naive_bayes(examples, cfg.hash_dim, cfg.alpha, cfg.evidence_cap)


def resolve(base_dir: Path, path: str) -> Path:
    p = Path(path)
    return p if p.is_absolute() else base_dir / p

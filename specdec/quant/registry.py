"""The quantization registry: spec strings, backends, availability.

Owns: `QuantSpec` (one parsed spec string), `Backend` (bit-widths, group sizes, devices, library and pip extra) and
the name registry (`backend`, `get`, `names`, `parse_spec`, `availability`). Knows nothing about any algorithm and
never imports an optional library; each backend module registers itself with `backend(...)`.
Spec grammar: `<name>[<bits>][_g<N> | _pc][_sym | _asym]`, e.g. `none`, `bf16`, `rtn4` (= rtn4_g64), `rtn3_g64_sym`,
`rtn8_pc` (one group per output row), `torchao_int4_g64`, `hqq3`.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

DEFAULT_GROUP_SIZE = 32
"""The project's default group size for group-wise backends. 32 divides every linear width of the
embedded SmolLM2-135M (576, 1536) and of the tiny test models (32, 64); 128 does not divide 576.
Caveat: the embedded model was shipped as GGUF Q4_1 (4-bit, blocks of 32), so asymmetric 4-bit g32
lands on the file's own grid and is nearly lossless; g64 is not. Reports state this."""


class QuantSpecError(ValueError):
    """A spec string that no backend accepts, or options a backend does not support."""


class BackendUnavailableError(RuntimeError):
    """A well-formed spec whose backend cannot run here (library missing, device unsupported)."""


@dataclass(frozen=True)
class QuantSpec:
    """One parsed quantization spec."""

    backend: str
    """Registered backend name (`rtn`, `bf16`, `torchao_int4`, ...)."""
    bits: int | None
    """Weight bit-width; None for dtype casts and `none`."""
    group_size: int | None
    """Weights per quantization group along the input dimension; None = one group per output row
    (per-channel) or not applicable (see `Backend.grouped`)."""
    symmetric: bool
    """Symmetric (zero-centred, no offset) rather than asymmetric (min/max affine) quantization."""

    @property
    def text(self) -> str:
        """The canonical spec string, defaults filled in (e.g. `rtn4` -> `rtn4_g64`)."""
        b = get(self.backend)
        out = self.backend + (str(self.bits) if b.bits_in_name else "")
        if b.grouped:
            out += f"_g{self.group_size}" if self.group_size is not None else "_pc"
        if b.symmetric_option and self.symmetric != b.default_symmetric:
            out += "_sym" if self.symmetric else "_asym"
        return out


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run on a device here, and if not, every reason why."""

    ok: bool
    """True when the backend can quantize and run a model on the device asked about."""
    reasons: tuple[str, ...] = ()
    """Each reason it cannot (device unsupported, library missing with its pip extra, probe failure)."""

    @property
    def reason(self) -> str:
        """The reasons as one line ("available" when there are none)."""
        return "; ".join(self.reasons) if self.reasons else "available"


Apply = Callable[..., "torch.nn.Module"]
"""`apply(model, spec) -> model`, or `apply(model, spec, tokenizer) -> model` for calibrated backends."""


@dataclass(frozen=True)
class Backend:
    """A registered quantization backend: capabilities plus the function that applies it."""

    name: str
    """Spec prefix (the spec's name part)."""
    apply: Apply
    """Quantize a model in place for `spec` and return it (possibly a new root module)."""
    description: str
    """One line for reports: algorithm, storage, compute dtype."""
    bits: tuple[int, ...] = ()
    """Supported bit-widths; empty for casts."""
    bits_in_name: bool = False
    """The bit-width follows the name in the spec (`rtn4`, `hqq3`); else it is fixed (`bits[0]`)."""
    grouped: bool = False
    """Takes `_g<N>` / `_pc`."""
    group_sizes: tuple[int, ...] | None = None
    """Allowed group sizes when grouped; None = any size that divides every quantized layer's width."""
    default_group_size: int | None = DEFAULT_GROUP_SIZE
    per_channel: bool = False
    """Accepts `_pc` (one group per output row)."""
    symmetric_option: bool = False
    """Takes `_sym` / `_asym`."""
    default_symmetric: bool = False
    """Symmetric when the spec says neither `_sym` nor `_asym`."""
    devices: tuple[str, ...] = ("cpu", "cuda")
    """Device types its kernels run on."""
    dtypes: tuple[torch.dtype, ...] | None = None
    """Model dtypes it accepts as input (None = any floating dtype)."""
    library: str | None = None
    """Import name of the optional library it needs (None = torch only)."""
    extra: str | None = None
    """The specdec pip extra that installs `library`."""
    probe: Callable[[], str | None] | None = None
    """Extra check once the library imports; returns a reason it cannot run, or None."""
    packed: bool = True
    """Weights are stored in the low-bit format (False: stored dequantized, numerics only)."""
    nominal_bits: Callable[[QuantSpec], float] | None = None
    """Bits per quantized weight incl. scales/zeros, where the measured bytes cannot show them: weights
    stored dequantized (rtn) or prepacked out of sight of the state dict (dynamic_fp16)."""
    calibrated: bool = False
    """Needs calibration data: `apply(model, spec, tokenizer)` (it tokenizes `specdec.quant.texts`)."""


_REGISTRY: dict[str, Backend] = {}


def backend(name: str, **capabilities) -> Callable[[Apply], Apply]:
    """Decorator: register the decorated apply function as backend `name` with `capabilities`
    (the other fields of `Backend`)."""

    def wrap(apply: Apply) -> Apply:
        if name in _REGISTRY:
            raise ValueError(f"quantization backend {name!r} is registered twice")
        _REGISTRY[name] = Backend(name=name, apply=apply, description=capabilities.pop("description"),
                                  **capabilities)
        return apply

    return wrap


def names() -> list[str]:
    """Every registered backend name, sorted."""
    return sorted(_REGISTRY)


def get(name: str) -> Backend:
    if name not in _REGISTRY:
        raise QuantSpecError(f"unknown quantization backend {name!r}; registered: {', '.join(names())}")
    return _REGISTRY[name]


def example_specs() -> list[str]:
    """One canonical spec per registered backend (its default bit-width and options)."""
    out = []
    for name in names():
        b = _REGISTRY[name]
        bits = (4 if 4 in b.bits else max(b.bits)) if b.bits_in_name else None
        out.append(name + (str(bits) if bits is not None else ""))
    return out


_OPTION = re.compile(r"^(?:g(?P<group>\d+)|(?P<pc>pc)|(?P<sym>sym)|(?P<asym>asym))$")


def parse_spec(spec: str | QuantSpec) -> QuantSpec:
    """Parse a spec string (see the module docstring) and check it against its backend's support."""
    if isinstance(spec, QuantSpec):
        return spec
    if not isinstance(spec, str) or not spec:
        raise QuantSpecError(f"a quantization spec is a non-empty string such as 'rtn4_g32', got {spec!r}")
    text = spec.strip().lower()
    matches = [n for n in _REGISTRY if text.startswith(n)]
    if not matches:
        raise QuantSpecError(f"quantization spec {spec!r} names no registered backend; "
                             f"registered: {', '.join(names())} (examples: {', '.join(example_specs())})")
    b = _REGISTRY[max(matches, key=len)]
    rest = text[len(b.name):]
    bits = b.bits[0] if b.bits and not b.bits_in_name else None
    if b.bits_in_name:
        digits = re.match(r"\d+", rest)
        if digits is None:
            raise QuantSpecError(f"{spec!r}: backend {b.name!r} needs a bit-width after its name, one of "
                                 f"{list(b.bits)} (e.g. {b.name}{b.bits[-1]})")
        bits, rest = int(digits.group()), rest[digits.end():]
        if bits not in b.bits:
            raise QuantSpecError(f"{spec!r}: backend {b.name!r} supports bit-widths {list(b.bits)}, not {bits}")
    if rest and not rest.startswith("_"):
        raise QuantSpecError(f"{spec!r}: cannot parse {rest!r} after {b.name!r}; options are separated by '_'")
    group = b.default_group_size if b.grouped else None
    symmetric = b.default_symmetric
    for option in filter(None, rest.split("_")):
        m = _OPTION.match(option)
        if m is None:
            raise QuantSpecError(f"{spec!r}: unknown option {option!r}; options are g<N>, pc, sym, asym")
        if (m["group"] or m["pc"]) and not b.grouped:
            raise QuantSpecError(f"{spec!r}: backend {b.name!r} takes no group size")
        if (m["sym"] or m["asym"]) and not b.symmetric_option:
            raise QuantSpecError(f"{spec!r}: backend {b.name!r} has no symmetric/asymmetric option")
        if m["group"]:
            group = int(m["group"])
            if group < 1 or (b.group_sizes is not None and group not in b.group_sizes):
                allowed = (list(b.group_sizes) if b.group_sizes is not None
                           else "any size >= 1 dividing the layer widths")
                raise QuantSpecError(f"{spec!r}: backend {b.name!r} supports group sizes {allowed}, not {group}")
        if m["pc"]:
            if not b.per_channel:
                raise QuantSpecError(f"{spec!r}: backend {b.name!r} has no per-channel mode; use _g<N>")
            group = None
        symmetric = bool(m["sym"]) if (m["sym"] or m["asym"]) else symmetric
    return QuantSpec(backend=b.name, bits=bits, group_size=group, symmetric=symmetric)


def _library_reason(b: Backend) -> str | None:
    """Why `b.library` cannot be used here, or None when it imports."""
    if b.library is None:
        return None
    try:
        importlib.import_module(b.library)
    except ImportError as err:
        return (f"needs the {b.library!r} library, which is not importable here ({err.__class__.__name__}: "
                f"{str(err).splitlines()[0] if str(err) else ''}): pip install 'specdec[{b.extra}]'")
    except (OSError, RuntimeError) as err:  # e.g. a compiled extension that fails to load
        return f"{b.library!r} is installed but failed to import: {err.__class__.__name__}: {err}"
    return None


def availability(spec: str | QuantSpec, device: str | torch.device = "cpu") -> Availability:
    """Can `spec` run on `device` here? Every reason it cannot is listed (device, library, probe)."""
    b = get(parse_spec(spec).backend)
    device_type = torch.device(device).type
    reasons = []
    if device_type not in b.devices:
        reasons.append(f"{b.name} runs on {' or '.join(b.devices)} only, not on {device_type}")
    library = _library_reason(b)
    if library:
        reasons.append(library)
    elif b.probe is not None:
        probe = b.probe()
        if probe:
            reasons.append(probe)
    return Availability(ok=not reasons, reasons=tuple(reasons))


"""Quantized targets: a registry of quantization backends selected by one spec string
(`load_target(..., quant="rtn3_g64")`, `quantize_target`, `quantized_copy`). Importing this package registers every
backend; optional libraries load only when used.
"""

import importlib
import pkgutil

from specdec.quant.layers import quantizable_linears, weight_bytes
from specdec.quant.quantize import check_quantizable, quantize_target, quantized_copy
from specdec.quant.registry import (
    DEFAULT_GROUP_SIZE, Availability, Backend, BackendUnavailableError, QuantSpec, QuantSpecError, availability,
    example_specs, get, names, parse_spec,
)
from specdec.quant.report import ReportConfig, quant_report
from specdec.quant.rtn import rtn_quantize

_FRAMEWORK = {"layers", "quantize", "registry", "report", "texts"}
for _module in pkgutil.iter_modules(__path__):
    if _module.name not in _FRAMEWORK:
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "DEFAULT_GROUP_SIZE", "Availability", "Backend", "BackendUnavailableError", "QuantSpec", "QuantSpecError",
    "ReportConfig", "availability", "check_quantizable", "example_specs", "get", "names", "parse_spec", "quant_report",
    "quantizable_linears", "quantize_target", "quantized_copy", "rtn_quantize", "weight_bytes",
]

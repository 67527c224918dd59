"""Copies of the bundled GGUF file with every quantized tensor rewritten to one type, written once under
~/.cache/llmserve: bf16 (the dense model llama.cpp and our engine compare on) or Q4_0 throughout (the
tied embedding / LM head too, as `llama-quantize --pure` makes it), by the `gguf` package's own code."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from inference_engine.model_loader import default_model_path

CACHE = Path.home() / ".cache" / "llmserve"
_DENSE = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)


def rewritten(qtype: gguf.GGMLQuantizationType) -> Path:
    """The bundled model with its quantized tensors as `qtype` (BF16 or one `gguf.quantize` takes)."""
    source = default_model_path()
    path = CACHE / source.name.replace(".Q4_1.", f".{qtype.name}.")
    if path.exists():
        return path
    reader = gguf.GGUFReader(str(source))
    scratch = path.with_suffix(".partial")
    scratch.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(scratch), arch=reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type)
    writer.add_file_type(gguf.LlamaFileType[f"MOSTLY_{qtype.name}"])
    for tensor in reader.tensors:
        shape = [int(d) for d in reversed(tensor.shape)]
        values = gguf.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        if tensor.tensor_type in _DENSE:
            writer.add_tensor(tensor.name, values.astype(np.float32))
        elif qtype == gguf.GGMLQuantizationType.BF16:
            bits = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(torch.bfloat16)
            writer.add_tensor(tensor.name, bits.view(torch.int16).numpy(), raw_dtype=qtype)
        else:
            writer.add_tensor(tensor.name, gguf.quantize(values.astype(np.float32), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    scratch.replace(path)
    return path

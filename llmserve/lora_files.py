"""LoRA adapter files as the admin takes them: a PEFT folder (``adapter_config.json`` and
``adapter_model.safetensors``, as `peft` saves them), given as a path or uploaded as a zip.

Both are read here without torch (the web tier never imports it): the config's JSON and the safetensors
header, which names every tensor with its shape, give the adapter's rank and target modules and catch what
the engine would refuse at start (a file missing, another PEFT method, a bias, DoRA, tensors that are not
LoRA pairs). A zip is refused when any member could land outside the folder it is extracted to (an absolute
path, ``..``, a symbolic link), is encrypted, or would unpack beyond `MAX_UNPACKED_BYTES`; only the two
adapter files are extracted, under names chosen here.
"""

from __future__ import annotations

import json
import re
import shutil
import stat
import struct
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO

from django.conf import settings

from llmserve import conf

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
MAX_UNPACKED_BYTES = 4 * 2**30  # a rank-64 adapter of every linear layer of a 70B model is about 1.7 GB
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit on its JSON header
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")


class AdapterFileError(ValueError):
    """An adapter the admin refuses; the message says why, for the person who gave it."""


@dataclass(frozen=True)
class AdapterInfo:
    rank: int  # the largest rank of any module (PEFT's rank_pattern lets modules differ)
    target_modules: list[str]  # the module kinds it adapts, e.g. ["q_proj", "v_proj"]


def inspect(config_text: bytes, weights: IO[bytes], weights_size: int) -> AdapterInfo:
    """The rank and targets of an adapter from its config file's bytes and its open weights file."""
    try:
        config = json.loads(config_text)
    except (UnicodeDecodeError, ValueError) as exc:
        raise AdapterFileError(f"{CONFIG_FILE} is not valid JSON ({exc}).") from None
    if not isinstance(config, dict):
        raise AdapterFileError(f"{CONFIG_FILE} is not a JSON object.")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterFileError(f"peft_type {config['peft_type']!r} is not LORA.")
    if config.get("bias", "none") != "none":
        raise AdapterFileError(f"bias {config['bias']!r} is not supported (only 'none').")
    if config.get("use_dora"):
        raise AdapterFileError("DoRA adapters are not supported.")
    if config.get("modules_to_save"):
        raise AdapterFileError("modules_to_save is not supported.")
    ranks: dict[str, int] = {}
    for key, shape in _tensor_shapes(weights, weights_size).items():
        match = _KEY.match(key)
        if match is None:
            raise AdapterFileError(f"{WEIGHTS_FILE} holds {key!r}, which is not a lora_A / lora_B weight.")
        if match["which"] == "A":
            if len(shape) != 2:
                raise AdapterFileError(f"{key!r} has shape {shape}, not [rank, in_features].")
            ranks[match["module"]] = shape[0]
    if not ranks:
        raise AdapterFileError(f"{WEIGHTS_FILE} holds no lora_A weights.")
    targets = sorted({module.rsplit(".", 1)[-1] for module in ranks})
    return AdapterInfo(rank=max(ranks.values()), target_modules=targets)


def _tensor_shapes(weights: IO[bytes], size: int) -> dict[str, list[int]]:
    """Tensor name -> shape, from a safetensors file's header (8 bytes of length, then JSON), checked against
    the file's size so that a truncated upload is caught here rather than by the engine."""
    head = weights.read(8)
    if len(head) < 8:
        raise AdapterFileError(f"{WEIGHTS_FILE} is too short to be a safetensors file.")
    (length,) = struct.unpack("<Q", head)
    if length > min(MAX_HEADER_BYTES, size - 8):
        raise AdapterFileError(f"{WEIGHTS_FILE} is not a safetensors file (bad header length).")
    try:
        header = json.loads(weights.read(length))
    except (UnicodeDecodeError, ValueError):
        raise AdapterFileError(f"{WEIGHTS_FILE} is not a safetensors file (unreadable header).") from None
    if not isinstance(header, dict):
        raise AdapterFileError(f"{WEIGHTS_FILE} is not a safetensors file (unreadable header).")
    shapes, end = {}, 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            shape, (_, stop) = [int(n) for n in entry["shape"]], entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise AdapterFileError(f"{WEIGHTS_FILE}: the entry of {name!r} is malformed.") from None
        shapes[name], end = shape, max(end, int(stop))
    if 8 + length + end != size:
        raise AdapterFileError(f"{WEIGHTS_FILE} is truncated or padded: its header does not match its size.")
    return shapes


def inspect_folder(path: str | Path) -> AdapterInfo:
    folder = Path(path)
    if not folder.is_dir():
        raise AdapterFileError(f"{path} is not a folder on this host.")
    config, weights = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    for file in (config, weights):
        if not file.is_file():
            raise AdapterFileError(f"{file.name} is missing from {path}.")
    with weights.open("rb") as stream:
        return inspect(config.read_bytes(), stream, weights.stat().st_size)


class AdapterZip:
    """An uploaded zip of a PEFT folder: its two files at the top or in one folder (as zipping the folder
    itself gives), checked when opened and extracted by `extract`."""

    def __init__(self, upload: IO[bytes]) -> None:
        try:
            self.zip = zipfile.ZipFile(upload)
        except (zipfile.BadZipFile, OSError, ValueError) as exc:
            raise AdapterFileError(f"The upload is not a zip file ({exc}).") from None
        members = self.zip.infolist()
        for member in members:
            _check_member(member)
        if sum(m.file_size for m in members) > MAX_UNPACKED_BYTES:
            raise AdapterFileError(f"The zip would unpack to more than {MAX_UNPACKED_BYTES} bytes.")
        configs = [m for m in members if PurePosixPath(m.filename).name == CONFIG_FILE and not m.is_dir()]
        if len(configs) != 1:
            raise AdapterFileError(
                f"The zip must hold exactly one {CONFIG_FILE} (found {len(configs)})."
                if configs
                else f"The zip holds no {CONFIG_FILE}: zip a folder saved by peft's save_pretrained."
            )
        folder = PurePosixPath(configs[0].filename).parent
        self.config = configs[0]
        try:
            self.weights = self.zip.getinfo(str(folder / WEIGHTS_FILE) if folder.parts else WEIGHTS_FILE)
        except KeyError:
            raise AdapterFileError(f"The zip holds no {WEIGHTS_FILE} beside its {CONFIG_FILE}.") from None
        with self.zip.open(self.weights) as weights:
            self.info = inspect(self._read(self.config), weights, self.weights.file_size)

    def _read(self, member: zipfile.ZipInfo) -> bytes:
        try:
            return self.zip.read(member)
        except (zipfile.BadZipFile, OSError, ValueError) as exc:  # a bad CRC, a broken stream
            raise AdapterFileError(f"{member.filename} cannot be read from the zip ({exc}).") from None

    def extract(self, name: str) -> Path:
        """The two adapter files written to a new folder of `storage_dir()`; its path. Written to a temporary
        name first, so that a folder with the final name is always complete."""
        root = storage_dir()
        root.mkdir(parents=True, exist_ok=True)
        final = root / f"{name.replace('/', '_').replace(':', '_')}-{uuid.uuid4().hex[:12]}"
        partial = root / f".partial-{final.name}"
        partial.mkdir()
        try:
            for member, target in ((self.config, CONFIG_FILE), (self.weights, WEIGHTS_FILE)):
                with self.zip.open(member) as source, (partial / target).open("wb") as out:
                    copied = _copy(source, out, member.file_size)
                if copied != member.file_size:
                    raise AdapterFileError(f"{member.filename} does not unpack to its declared size.")
            partial.rename(final)
        except (zipfile.BadZipFile, OSError, ValueError) as exc:
            shutil.rmtree(partial, ignore_errors=True)
            if isinstance(exc, AdapterFileError):
                raise
            raise AdapterFileError(f"The zip cannot be extracted ({exc}).") from None
        return final


def _check_member(member: zipfile.ZipInfo) -> None:
    name = member.filename.replace("\\", "/")
    path = PurePosixPath(name)
    if path.is_absolute() or re.match(r"^[A-Za-z]:", name) or ".." in path.parts:
        raise AdapterFileError(f"The zip member {member.filename!r} points outside the folder.")
    if stat.S_ISLNK(member.external_attr >> 16):
        raise AdapterFileError(f"The zip member {member.filename!r} is a symbolic link.")
    if member.flag_bits & 0x1:
        raise AdapterFileError(f"The zip member {member.filename!r} is encrypted.")


def _copy(source: IO[bytes], out: IO[bytes], declared: int) -> int:
    """Copy at most one byte past `declared` (a member whose data is longer than its header says is refused,
    not unpacked without end)."""
    copied = 0
    while chunk := source.read(min(2**20, declared + 1 - copied)):
        out.write(chunk)
        copied += len(chunk)
        if copied > declared:
            break
    return copied


def storage_dir() -> Path:
    """Where uploaded adapters are extracted: ``LLMSERVE["LORA_DIR"]``, else ``lora/`` under MEDIA_ROOT."""
    configured = conf.get("LORA_DIR")
    return Path(configured or Path(settings.MEDIA_ROOT or ".") / "lora").resolve()


def remove_upload(path: str) -> None:
    """Delete a folder `extract` made (nothing outside `storage_dir()` is ever deleted)."""
    folder = Path(path).resolve()
    if folder.parent == storage_dir() and folder.is_dir():
        shutil.rmtree(folder, ignore_errors=True)

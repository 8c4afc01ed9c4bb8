"""Convert the published Kimi K3 checkpoint into this project's fast local layout.

    python -m kimi_k3.convert --hf-path IN --out OUT [--dense-bits 4|8|16]
        [--expert-bits 4|3|2] [--verify]

OUT gets the dense weights (MLX affine-quantized, or bf16 with ``--dense-bits 16``) in safetensors
shards under this module tree's names, the routed experts in an expert pack
(``kimi_k3.checkpoint.expert_pack``): copied bit-exactly (MXFP4, ``--expert-bits 4``), or
requantized to 3 or 2 bits (``kimi_k3.convert.requant``), ``config.json`` with MLX's
``quantization`` entry (naming the experts' format where it is not MXFP4), the
tokenizer files (never code), ``kimi_k3_checksums.json`` (crc32 per dense tensor, checked at load:
``kimi_k3.checkpoint.checksums``) and ``kimi_k3_manifest.json`` (versions, settings, sha256 per
file), written last. Memory stays bounded by one chunk of one tensor (``--chunk-mb``) plus one
expert record per worker, whatever the checkpoint's size. Every output file is written under a
temporary name and renamed when complete; a rerun after an interruption skips the files already
complete (``.kimi_k3_convert_state.json`` records them with their checksums). docs/converter.md
describes the layout and the guarantees.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import re
import resource
import shutil
import signal
import struct
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from kimi_k3.checkpoint import checksums
from kimi_k3.checkpoint import expert_pack as ep
from kimi_k3.checkpoint.files import (
    DTYPE_SIZE,
    MAX_CONFIG_BYTES,
    NON_TEXT_PREFIXES,
    NP_DTYPE,
    CheckpointError,
    CheckpointIndex,
    TensorInfo,
    load_json_object,
    open_regular,
    read_capped,
    sha256_file,
    write_text_atomic,
)
from kimi_k3.checkpoint.layouts import detect
from kimi_k3.cli import Parser
from kimi_k3.convert.requant import requantize_record
from kimi_k3.model.config import ConfigError, ModelArgs, naming
from kimi_k3.model.experts import FORMAT_KEY, FORMATS, MXFP4, ExpertFormat
from kimi_k3.model.model import Model, sanitize_weights
from kimi_k3.model.parallel import expert_range
from kimi_k3.text.tokenizer import HF_FILE, RANK_FILE, write_hf_tokenizer

MANIFEST = "kimi_k3_manifest.json"
STATE = ".kimi_k3_convert_state.json"
FORMAT, VERSION = "kimi-k3-converted", 1
# Tests only: SIGKILL this process once it has converted this many source bytes.
KILL_ENV = "KIMI_K3_CONVERT_KILL_AFTER_BYTES"
_EXPERT = re.compile(
    r"language_model\.model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\."
    r"(w[123]\.weight_(?:packed|scale))$"
)
_MX = {"BF16": mx.bfloat16, "F16": mx.float16, "F32": mx.float32}
_ST = {mx.bfloat16: "BF16", mx.float16: "F16", mx.float32: "F32", mx.uint32: "U32"}
# Copied from the source as they are: the tokenizer, its config and the chat template; never
# code (``*.py``) or this project's own files (rewritten for the output, or not its own).
_NOT_COPIED = ("config.json", "model.safetensors.index.json", MANIFEST, checksums.NAME)
_COPIED = (".json", ".model", ".tiktoken", ".jinja")


class ConvertError(CheckpointError):
    """The output directory cannot take this conversion (other settings, foreign files)."""


@dataclass(frozen=True)
class Settings:
    """What decides the output bytes (a rerun must use the same to resume)."""

    dense_bits: int = 4
    group_size: int = 64
    shard_bytes: int = 4 << 30
    pack_file_bytes: int = 4 << 30
    ranks: int = 1  # the expert pack holds rank ``rank``'s share of every layer's experts
    rank: int = 0
    expert_bits: int = 4  # 4: the published MXFP4 bytes; 3, 2: requantized (FORMATS)

    def experts(self, num_experts: int) -> range:
        """The experts of every MoE layer the pack holds (``parallel.expert_range``)."""
        return expert_range(num_experts, self.ranks, self.rank)

    @property
    def expert_format(self) -> ExpertFormat:
        return FORMATS[self.expert_bits]


@dataclass
class DenseItem:
    """One source tensor and the output tensors it becomes (in write order)."""

    source: TensorInfo
    name: str  # this tree's name (the weight's, when quantized)
    shape: tuple
    spec: dict | None  # MLX quantization parameters, or None to keep it as it is

    @property
    def outputs(self) -> list[tuple[str, str, tuple]]:
        dt = self.source.dtype
        if self.spec is None:
            return [(self.name, dt, self.shape)]
        o, i = self.shape
        path, groups = self.name[: -len(".weight")], (o, i // self.spec["group_size"])
        return [
            (self.name, "U32", (o, i * self.spec["bits"] // 32)),
            (f"{path}.scales", dt, groups),
            (f"{path}.biases", dt, groups),
        ]

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(s)) * DTYPE_SIZE[d] for _, d, s in self.outputs)


@dataclass
class Plan:
    """Every output file and what goes in it, computed from the source headers alone."""

    shards: list[list[DenseItem]]
    quantization: dict | None
    layouts: dict[int, ep.RecordLayout]  # of the records written
    experts: dict[int, list[list[TensorInfo]]]  # layer -> expert -> six sources (TENSORS order)
    pack_files: list[list[tuple[int, int]]]
    expert_format: ExpertFormat = MXFP4

    @property
    def shard_names(self) -> list[str]:
        n = len(self.shards)
        return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]

    @property
    def pack_names(self) -> list[str]:
        n = len(self.pack_files)
        return [f"{ep.PACK_DIR}/{ep.file_name(i, n)}" for i in range(n)]

    def source_bytes(self, rel: str) -> int:
        """Source bytes a large output file is made from (the progress unit)."""
        if rel in self.shard_names:
            return sum(it.source.nbytes for it in self.shards[self.shard_names.index(rel)])
        recs = self.pack_files[self.pack_names.index(rel)]
        return sum(t.nbytes for layer, e in recs for t in self.experts[layer][e])


def make_plan(src: CheckpointIndex, args: ModelArgs, settings: Settings) -> Plan:
    """Validate the source against the model and lay out every output file."""
    dense, experts = [], {}
    for name, info in src.tensors.items():
        if name.startswith(NON_TEXT_PREFIXES):
            continue
        if m := _EXPERT.match(name):
            layer, e = int(m.group(1)), int(m.group(2))
            experts.setdefault(layer, {}).setdefault(e, {})[m.group(3)] = info
        else:
            dense.append(info)
    items, quantization = _plan_dense(src, args, settings, dense)
    fmt = settings.expert_format
    if fmt != MXFP4:
        _check_groups(src, args, fmt)
        quantization = {**(quantization or {}), FORMAT_KEY: fmt.to_json()}
    shards, size = [[]], 0
    for it in items:
        if shards[-1] and size + it.nbytes > settings.shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(it)
        size += it.nbytes
    layouts, sources = _plan_experts(src, args, experts)
    if fmt != MXFP4:
        Dl, I = args.routed_expert_hidden_size, args.moe_intermediate_size
        layouts = {l: ep.RecordLayout.from_format(fmt, Dl, I) for l in layouts}
    held = settings.experts(args.num_experts)
    pack = ep.plan_files({l: (layouts[l], held) for l in layouts}, settings.pack_file_bytes)
    return Plan(shards, quantization, layouts, sources, pack, fmt)


def _check_groups(src, args, fmt: ExpertFormat):
    """The experts' widths split into whole groups of ``fmt``."""
    for key in ("routed_expert_hidden_size", "moe_intermediate_size"):
        n = getattr(args, key)
        if n % fmt.group_size:
            raise ConvertError(
                f"{src.path}: config value {key}={n} is not a multiple of {fmt.group_size}, "
                f"the group size of {fmt} experts"
            )


def _plan_dense(src, args, settings, infos) -> tuple[list[DenseItem], dict | None]:
    model = Model(args)  # a skeleton: its arrays are lazy and never evaluated
    modules = dict(tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module))
    params = {
        k: tuple(v.shape) for k, v in tree_flatten(model.parameters()) if ".experts." not in k
    }
    bits, gs = settings.dense_bits, settings.group_size
    quant = None if bits == 16 else {"group_size": gs, "bits": bits, "mode": "affine"}
    items = []
    for info in sorted(infos, key=lambda t: (t.file.name, t.start)):
        ((name, value),) = sanitize_weights(args, {info.name: _placeholder(info)}).items()
        want = params.pop(name, None)
        if want is None:
            raise CheckpointError(
                f"{info.file}: tensor {info.name} is not part of Kimi K3 as configured"
            )
        if tuple(value.shape) != want:
            raise CheckpointError(
                f"{info.file}: tensor {info.name} has shape "
                f"{list(info.shape)}, expected {list(want)}"
            )
        path = name[: -len(".weight")] if name.endswith(".weight") else None
        spec = _quant_spec(model, quant, path, modules.get(path))
        items.append(DenseItem(info, name, want, spec))
    if params:
        first = sorted(params)[0]
        raise CheckpointError(
            f"{src.path}: tensor {first} is missing from the checkpoint ({len(params)} missing)"
        )
    return items, quant


def _placeholder(info: TensorInfo) -> mx.array:
    return mx.zeros(info.shape, _MX.get(info.dtype, mx.uint8))  # lazy: shape only


def _quant_spec(model: Model, quant: dict | None, path: str | None, module) -> dict | None:
    """``Model.quant_predicate`` decides; a weight whose rows do not split into whole groups
    stays as it is (recorded as ``path: false`` in the config)."""
    if quant is None or module is None or "weight" not in module:
        return None
    want = model.quant_predicate(path, module)
    if not want:
        return None
    spec = {k: quant[k] for k in ("group_size", "bits", "mode")}
    if isinstance(want, dict):
        spec.update(want)
        quant[path] = spec
    if module.weight.ndim != 2 or module.weight.shape[-1] % spec["group_size"]:
        quant[path] = False
        return None
    return spec


def _plan_experts(src, args, found: dict) -> tuple[dict, dict]:
    moe = [i for i in range(args.num_hidden_layers) if args.is_moe(i)]
    for layer in sorted(set(found) - set(moe)):
        raise CheckpointError(
            f"{src.path}: layer {layer} has routed experts but is not a MoE layer in config.json"
        )
    I, Dl = args.moe_intermediate_size, args.routed_expert_hidden_size
    want = {
        "w1.weight_packed": (I, Dl // 2),
        "w1.weight_scale": (I, Dl // 32),
        "w2.weight_packed": (Dl, I // 2),
        "w2.weight_scale": (Dl, I // 32),
        "w3.weight_packed": (I, Dl // 2),
        "w3.weight_scale": (I, Dl // 32),
    }
    layouts, sources = {}, {}
    for layer in moe:
        base = f"language_model.model.layers.{layer}.block_sparse_moe.experts"
        per = found.get(layer, {})
        extra = sorted(set(per) - set(range(args.num_experts)))
        if extra:
            raise CheckpointError(
                f"{src.path}: tensor {base}.{extra[0]}.w1.weight_packed is "
                f"beyond num_experts={args.num_experts}"
            )
        rows = []
        for e in range(args.num_experts):
            six = per.get(e, {})
            for short, shape in want.items():
                t = six.get(short)
                if t is None:
                    raise CheckpointError(
                        f"{src.path}: tensor {base}.{e}.{short} is missing from the checkpoint"
                    )
                if t.dtype != "U8" or tuple(t.shape) != shape:
                    raise CheckpointError(
                        f"{t.file}: tensor {t.name} is {t.dtype}"
                        f"{list(t.shape)}, expected U8{list(shape)} (MXFP4)"
                    )
            rows.append([six[ep.source_name(n)] for n in ep.TENSORS])
        layouts[layer] = ep.RecordLayout.from_published(want, base)
        sources[layer] = rows
    return layouts, sources


def fingerprint(src: CheckpointIndex, config_text: str, settings: Settings) -> str:
    """What makes two runs produce the same bytes: source headers, config, settings, code."""
    h = hashlib.sha256()
    h.update(json.dumps([dataclasses.asdict(settings), _versions(), config_text]).encode())
    for name in sorted(src.tensors):
        t = src.tensors[name]
        h.update(f"{name}|{t.file.name}|{t.dtype}|{t.shape}|{t.start}|{t.end}\n".encode())
    return h.hexdigest()


def _versions() -> dict:
    try:
        ours = version("kimi-k3")
    except PackageNotFoundError:
        ours = "unknown"
    return {"kimi_k3": ours, "mlx": mx.__version__}


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1000
    return ""


class Progress:
    """A plain-stderr progress line: bytes done of total, rate and ETA (thread-safe)."""

    def __init__(self, label: str, total: int, done: int = 0, stream=None):
        self.label, self.total, self.done = label, total, done
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.start, self.start_done, self.last = time.monotonic(), done, 0.0
        self.lock = threading.Lock()
        kill = os.environ.get(KILL_ENV)
        self.kill_at = done + int(kill) if kill else None

    def update(self, n: int):
        with self.lock:
            self.done += n
            if self.kill_at is not None and self.done >= self.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            now = time.monotonic()
            if now - self.last >= (0.25 if self.tty else 10.0):
                self.last = now
                self._show(now)

    def _show(self, now: float, end: str | None = None):
        rate = (self.done - self.start_done) / max(now - self.start, 1e-9)
        left = (self.total - self.done) / rate if rate > 0 else float("inf")
        eta = "--" if left == float("inf") else time.strftime("%H:%M:%S", time.gmtime(left))
        pct = 100.0 * self.done / max(self.total, 1)
        line = (
            f"{self.label}: {_fmt_bytes(self.done)} / {_fmt_bytes(self.total)} "
            f"({pct:.1f}%)  {_fmt_bytes(rate)}/s  ETA {eta}"
        )
        self.stream.write(
            ("\r" + line + "\x1b[K" if self.tty else line) + (end or ("" if self.tty else "\n"))
        )
        self.stream.flush()

    def close(self):
        with self.lock:
            self._show(time.monotonic(), end="\n")


class _Run:
    """One conversion: the plan, the output directory's state, and the writers."""

    def __init__(self, src, out, plan, settings, fp, chunk_bytes, workers, config):
        self.src, self.out, self.plan, self.settings = src, out, plan, settings
        self.fp, self.chunk_bytes, self.workers, self.config = fp, chunk_bytes, workers, config
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.fds: dict[Path, int] = {}
        self.state = self._load_state()

    def _load_state(self) -> dict:
        file = self.out / STATE
        if not file.exists():
            return {"fingerprint": self.fp, "done": {}}
        state = json.loads(file.read_text())
        if state.get("fingerprint") != self.fp:
            raise ConvertError(
                f"{self.out}: holds a partial conversion from another source or "
                "with other settings; delete it or choose another --out"
            )
        # A file counts as done only if it is there with its recorded size.
        done = {
            rel: d
            for rel, d in state["done"].items()
            if (self.out / rel).is_file() and (self.out / rel).stat().st_size == d["bytes"]
        }
        return {"fingerprint": self.fp, "done": done}

    def _mark_done(self, rel: str, record: dict):
        with self.lock:
            self.state["done"][rel] = record
            self.save_state()

    def save_state(self):
        write_text_atomic(self.out / STATE, json.dumps(self.state, separators=(",", ":")))

    @contextlib.contextmanager
    def _atomic(self, rel: str):
        final = self.out / rel
        tmp = final.with_name(f".{final.name}.tmp")
        try:
            with open(tmp, "wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, final)

    def _pread(self, file: Path, offset: int, n: int) -> bytes:
        with self.lock:
            fd = self.fds.get(file)
            if fd is None:
                fd = self.fds[file] = open_regular(file)[0]
        data = os.pread(fd, n, offset)
        if len(data) != n:
            raise CheckpointError(f"{file}: short read at byte {offset} (file truncated?)")
        return data

    def run(self, progress: Progress):
        todo_shards = [
            i for i, rel in enumerate(self.plan.shard_names) if rel not in self.state["done"]
        ]
        todo_packs = [
            i for i, rel in enumerate(self.plan.pack_names) if rel not in self.state["done"]
        ]
        (self.out / ep.PACK_DIR).mkdir(parents=True, exist_ok=True)
        with ThreadPoolExecutor(max(1, self.workers)) as pool:
            futures = [pool.submit(self._pack_file, i, progress) for i in todo_packs]
            try:
                for i in todo_shards:  # MLX work stays on this thread
                    self._dense_shard(i, progress)
                    for f in futures:  # a failed pack file stops the run now
                        if f.done() and f.exception():
                            f.result()
                for f in futures:
                    f.result()
            except BaseException:
                self.stop.set()
                raise
        for fd in self.fds.values():
            os.close(fd)

    def _pack_file(self, i: int, progress: Progress):
        rel = self.plan.pack_names[i]
        with self._atomic(rel) as f:
            w, crcs = ep.RecordWriter(f), []
            for layer, e in self.plan.pack_files[i]:
                if self.stop.is_set():
                    raise InterruptedError("stopped")
                six = self.plan.experts[layer][e]
                data = self._read_expert(six)
                if self.plan.expert_format != MXFP4:
                    record = requantize_record(
                        _split(data, six), self.plan.expert_format, f"{six[0].file}: {_base(six)}"
                    )
                else:
                    record = data
                crcs.append(w.add(record)[1])
                progress.update(len(data))
        self._mark_done(rel, {"bytes": w.size, "sha256": w.sha256.hexdigest(), "crc32": crcs})

    def _read_expert(self, six: list[TensorInfo]) -> bytes:
        """One expert's six tensors: one read when they lie back to back (as published)."""
        if all(a.file == b.file and a.end == b.start for a, b in zip(six, six[1:], strict=False)):
            return self._pread(six[0].file, six[0].start, six[-1].end - six[0].start)
        return b"".join(self._pread(t.file, t.start, t.nbytes) for t in six)

    def _dense_shard(self, i: int, progress: Progress):
        rel, items = self.plan.shard_names[i], self.plan.shards[i]
        header, offset = {}, 0
        for it in items:
            for name, dtype, shape in it.outputs:
                n = int(np.prod(shape)) * DTYPE_SIZE[dtype]
                header[name] = {
                    "dtype": dtype,
                    "shape": list(shape),
                    "data_offsets": [offset, offset + n],
                }
                offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * ((-len(raw)) % 8)
        sha, size = hashlib.sha256(), 0
        sizes = [(name, h["data_offsets"][1] - h["data_offsets"][0]) for name, h in header.items()]
        crcs = checksums.TensorHasher(sizes, skip=8 + len(raw))
        with self._atomic(rel) as f:
            for data, consumed in self._shard_bytes(raw, items):
                f.write(data)
                sha.update(data)
                crcs.update(data)
                size += len(data)
                if consumed:
                    progress.update(consumed)
        if size != 8 + len(raw) + offset:
            raise AssertionError(f"{rel}: wrote {size} bytes, planned {8 + len(raw) + offset}")
        self._mark_done(
            rel, {"bytes": size, "sha256": sha.hexdigest(), "tensor_crc32": crcs.result()}
        )

    def _shard_bytes(self, header: bytes, items: list[DenseItem]):
        yield struct.pack("<Q", len(header)) + header, 0
        for it in items:
            if it.spec is not None:
                yield from self._quantized(it)
            elif tuple(it.source.shape) == it.shape:
                t = it.source
                for a in range(t.start, t.end, self.chunk_bytes):
                    n = min(self.chunk_bytes, t.end - a)
                    yield self._pread(t.file, a, n), n
            else:  # renamed and reshaped (A_log padding): tiny, done whole
                t = it.source
                value = _to_mx(self._pread(t.file, t.start, t.nbytes), t.dtype, t.shape)
                ((_, value),) = sanitize_weights(self.config, {t.name: value}).items()
                yield _to_bytes(value), t.nbytes

    def _quantized(self, it: DenseItem):
        """Affine-quantize row blocks of at most ``chunk_bytes``: weight bytes stream out
        block by block; scales and biases (together 1/32 of the source at group 64) follow."""
        t, spec = it.source, it.spec
        rows, cols = t.shape
        row_bytes = cols * DTYPE_SIZE[t.dtype]
        step = max(1, self.chunk_bytes // row_bytes)
        scales, biases = [], []
        for r in range(0, rows, step):
            n = min(step, rows - r)
            w = _to_mx(
                self._pread(t.file, t.start + r * row_bytes, n * row_bytes), t.dtype, (n, cols)
            )
            q, s, b = mx.quantize(
                w, group_size=spec["group_size"], bits=spec["bits"], mode=spec["mode"]
            )
            scales.append(_to_bytes(s))
            biases.append(_to_bytes(b))
            data = _to_bytes(q)
            del w, q, s, b
            mx.clear_cache()
            yield data, n * row_bytes
        yield b"".join(scales), 0
        yield b"".join(biases), 0

    def finish(self, hf_path: Path, config: dict) -> dict:
        done = self.state["done"]
        shards = zip(self.plan.shard_names, self.plan.shards, strict=True)
        weight_map = {
            name: rel for rel, items in shards for it in items for name, _, _ in it.outputs
        }
        total = sum(it.nbytes for items in self.plan.shards for it in items)
        write_text_atomic(
            self.out / "model.safetensors.index.json",
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1),
        )
        self._pack_index()
        self._checksums()
        if self.plan.quantization:
            config = {**config, "quantization": self.plan.quantization}
        write_text_atomic(self.out / "config.json", json.dumps(config, indent=1))
        aux = [f.name for f in _aux_files(hf_path)]
        for f in _aux_files(hf_path):
            tmp = self.out / f".{f.name}.tmp"
            shutil.copyfile(f, tmp)
            os.replace(tmp, self.out / f.name)
        if HF_FILE not in aux and (self.out / RANK_FILE).is_file():
            write_hf_tokenizer(self.out)  # Hugging Face loaders then need no remote code
            aux.append(HF_FILE)
        files = {rel: {"bytes": d["bytes"], "sha256": d["sha256"]} for rel, d in done.items()}
        small = ["model.safetensors.index.json", f"{ep.PACK_DIR}/{ep.INDEX}", "config.json", *aux]
        for rel in small:
            files[rel] = {
                "bytes": (self.out / rel).stat().st_size,
                "sha256": sha256_file(self.out / rel),
            }
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "versions": _versions(),
            "source": str(hf_path),
            "fingerprint": self.fp,
            "settings": dataclasses.asdict(self.settings),
            "quantization": self.plan.quantization,
            "files": dict(sorted(files.items())),
        }
        write_text_atomic(self.out / MANIFEST, json.dumps(manifest, indent=1))
        (self.out / STATE).unlink(missing_ok=True)
        return manifest

    def _checksums(self):
        """The dense shards' per-tensor crc32 (``kimi_k3.checkpoint.checksums``), computed as
        written.
        No mtimes (the output stays the same bytes run after run): the first load reads the
        shards once, checks them against these, and records their mtimes."""
        files = {
            rel: {"bytes": d["bytes"], "mtime_ns": None, "tensors": d["tensor_crc32"]}
            for rel, d in self.state["done"].items()
            if rel in self.plan.shard_names
        }
        checksums.write_manifest(self.out / checksums.NAME, checksums.Checksums(files))

    def _pack_index(self):
        records, sizes = {}, []
        files = zip(self.plan.pack_names, self.plan.pack_files, strict=True)
        for i, (rel, recs) in enumerate(files):
            crcs, offset = self.state["done"][rel]["crc32"], 0
            for (layer, e), crc in zip(recs, crcs, strict=True):
                records[(layer, e)] = (i, offset, crc)
                offset += self.plan.layouts[layer].record_bytes
            sizes.append(offset)
        names = [Path(r).name for r in self.plan.pack_names]
        held = self.settings.experts(self.config.num_experts)
        part = held if self.settings.ranks > 1 else None
        doc = ep.index_json(self.plan.layouts, names, sizes, records, part, self.plan.expert_format)
        write_text_atomic(self.out / ep.PACK_DIR / ep.INDEX, json.dumps(doc, separators=(",", ":")))


def _split(data: bytes, six: list[TensorInfo]) -> dict[str, np.ndarray]:
    """One expert's bytes (``_read_expert``: its six tensors back to back in TENSORS order)
    as the published tensors, by short name (``w1.weight_packed``, ...)."""
    out, offset = {}, 0
    for name, t in zip(ep.TENSORS, six, strict=True):
        out[ep.source_name(name)] = np.frombuffer(
            data, np.uint8, count=t.nbytes, offset=offset
        ).reshape(t.shape)
        offset += t.nbytes
    return out


def _base(six: list[TensorInfo]) -> str:
    """The tensor name shared by an expert's six tensors (``...experts.E``)."""
    return six[0].name.rsplit(".", 2)[0]


def _to_mx(buf: bytes, dtype: str, shape: tuple) -> mx.array:
    a = np.frombuffer(buf, dtype=NP_DTYPE[dtype]).reshape(shape)
    return mx.array(a).view(mx.bfloat16) if dtype == "BF16" else mx.array(a)


def _to_bytes(a: mx.array) -> bytes:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.array(a).tobytes()


def _aux_files(hf_path: Path) -> list[Path]:
    """The tokenizer, its configs and the chat template, copied as they are (never code,
    the shards or the index)."""
    return sorted(
        f
        for f in hf_path.iterdir()
        if f.is_file()
        and f.suffix in _COPIED
        and f.name not in _NOT_COPIED
        and not f.name.startswith(".")
    )


def _check_out(out: Path, fp: str) -> str:
    """``"new"``, ``"resume"`` or ``"done"``; refuses a directory holding anything else."""
    if (out / MANIFEST).is_file():
        if json.loads((out / MANIFEST).read_text()).get("fingerprint") != fp:
            raise ConvertError(
                f"{out}: holds a conversion from another source or with other "
                "settings; delete it or choose another --out"
            )
        return "done"
    if (out / STATE).is_file():
        return "resume"
    if out.exists() and any(out.iterdir()):
        raise ConvertError(
            f"{out}: exists and is not empty (and holds no conversion to "
            "resume); choose an empty or new --out"
        )
    return "new"


def describe(plan: Plan) -> str:
    """What a conversion writes: file counts and sizes."""
    dense = sum(it.nbytes for items in plan.shards for it in items)
    pack = sum(plan.layouts[l].record_bytes for f in plan.pack_files for l, _ in f)
    quantized = sum(it.spec is not None for items in plan.shards for it in items)
    return (
        f"dense: {len(plan.shards)} shards, {_fmt_bytes(dense)} ({quantized} quantized "
        f"weights); experts ({plan.expert_format}): {len(plan.pack_files)} pack files, "
        f"{_fmt_bytes(pack)}; total {_fmt_bytes(dense + pack)}"
    )


def convert(
    hf_path: str | Path,
    out: str | Path,
    settings: Settings = Settings(),
    verify: bool = False,
    workers: int = 4,
    chunk_bytes: int = 256 << 20,
    stream=None,
    dry_run: bool = False,
) -> dict | None:
    """Convert (or resume converting) ``hf_path`` into ``out``; returns the manifest.

    ``dry_run`` validates the source, prints what would be written and returns None.
    """
    hf_path, out = Path(hf_path), Path(out)
    stream = stream or sys.stderr
    if settings.dense_bits not in (4, 8, 16):
        raise ConvertError(f"--dense-bits {settings.dense_bits}: use 4, 8 or 16")
    if settings.expert_bits not in FORMATS:
        raise ConvertError(f"--expert-bits {settings.expert_bits}: use 4, 3 or 2")
    if settings.ranks < 1 or not 0 <= settings.rank < settings.ranks:
        raise ConvertError(
            f"--rank {settings.rank} --ranks {settings.ranks}: the rank must be in 0..ranks-1"
        )
    layout = detect(hf_path)
    if layout != "published":
        raise ConvertError(
            f"{hf_path}: is in the {layout!r} layout; convert from the published "
            "checkpoint (the converted and mlx-lm layouts load directly)"
        )
    file = hf_path / "config.json"  # read once: what is fingerprinted is what is written
    config_text = read_capped(file, MAX_CONFIG_BYTES).decode("utf-8")  # detect checked UTF-8
    config = load_json_object(config_text, file, ConfigError)
    with naming(file):
        args = ModelArgs.from_dict(config)
    src = CheckpointIndex(hf_path)
    fp = fingerprint(src, config_text, settings)
    status = _check_out(out, fp)
    if dry_run:
        stream.write(describe(make_plan(src, args, settings)) + "\n")
        return None
    if status == "done":
        stream.write(f"{out}: already converted (manifest matches)\n")
    else:
        plan = make_plan(src, args, settings)
        out.mkdir(parents=True, exist_ok=True)
        run = _Run(src, out, plan, settings, fp, chunk_bytes, workers, args)
        run.save_state()
        large = plan.shard_names + plan.pack_names
        total = sum(plan.source_bytes(r) for r in large)
        done = sum(plan.source_bytes(r) for r in large if r in run.state["done"])
        stream.write(
            f"converting {hf_path} -> {out} ({_fmt_bytes(total)}), dense "
            f"{settings.dense_bits}-bit, experts {settings.expert_format}: {describe(plan)}\n"
        )
        if done:
            n = sum(r in run.state["done"] for r in large)
            stream.write(f"resuming: {n} of {len(large)} files already complete\n")
        progress = Progress("converting", total, done, stream)
        start = time.monotonic()
        run.run(progress)
        progress.close()
        run.finish(hf_path, config)
        secs = time.monotonic() - start
        stream.write(
            f"converted {_fmt_bytes(total - done)} in {secs:.1f} s; peak RSS "
            f"{peak_rss_mb():.0f} MB\n"
        )
    if verify:
        verify_output(out, workers, stream)
    return json.loads((out / MANIFEST).read_text())


def peak_rss_mb() -> float:
    """This process's peak resident set size in MB (ru_maxrss: KB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024


def verify_output(out: str | Path, workers: int = 4, stream=None) -> int:
    """Re-read every file of a converted directory: sha256 of each file against the manifest,
    crc32 of every expert record. Raises ``CheckpointError`` naming the first bad file."""
    out, stream = Path(out), stream or sys.stderr
    file = out / MANIFEST
    if not file.is_file():
        raise ConvertError(f"{file}: no manifest (conversion not finished?)")
    files = json.loads(file.read_text())["files"]
    for rel, meta in files.items():
        if not (out / rel).is_file():
            raise CheckpointError(f"{out / rel}: missing (listed in {MANIFEST})")
        if (out / rel).stat().st_size != meta["bytes"]:
            raise CheckpointError(
                f"{out / rel}: {(out / rel).stat().st_size} bytes, the "
                f"manifest says {meta['bytes']}"
            )
    progress = Progress("verifying", sum(m["bytes"] for m in files.values()), stream=stream)
    pack = ep.ExpertPack(out)
    pack_rel = {f"{ep.PACK_DIR}/{f.name}": i for i, f in enumerate(pack.files)}

    def check(rel: str):
        if rel in pack_rel:
            got = pack.verify_file(pack_rel[rel], progress.update)
        else:
            got = sha256_file(out / rel, progress.update)
        if got != files[rel]["sha256"]:
            raise CheckpointError(
                f"{out / rel}: sha256 does not match the manifest: the file "
                "is corrupted; reconvert (or re-copy) it"
            )

    with ThreadPoolExecutor(max(1, workers)) as pool:
        for f in [pool.submit(check, rel) for rel in files]:
            f.result()
    pack.close()
    progress.close()
    stream.write(
        f"verified {len(files)} files and {sum(1 for _ in pack.records())} expert records\n"
    )
    return len(files)


def setup_arg_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or Parser(
        prog="python -m kimi_k3.convert",
        description=__doc__.splitlines()[0],
        epilog="python -m kimi_k3.convert synth OUT --preset NAME writes a synthetic "
        "checkpoint instead (its own --help)",
    )
    parser.add_argument("--hf-path", required=True, help="the published checkpoint directory")
    parser.add_argument("--out", required=True, help="output directory (new, or to resume)")
    parser.add_argument(
        "--dense-bits",
        type=int,
        default=4,
        choices=(4, 8, 16),
        help="dense weights: MLX affine 4 or 8 bit, or 16 (kept bf16)",
    )
    parser.add_argument(
        "--expert-bits",
        type=int,
        default=4,
        choices=sorted(FORMATS, reverse=True),
        help="routed experts: 4 keeps the published MXFP4 bytes; 3 or 2 requantizes them "
        "(MLX affine, groups of 64, fitted to the MXFP4 values; docs/converter.md)",
    )
    parser.add_argument("--group-size", type=int, default=64, choices=(32, 64, 128))
    parser.add_argument(
        "--verify", action="store_true", help="re-read every output file and check its checksums"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="check the source and print what would be written (sizes)",
    )
    parser.add_argument("--shard-mb", type=float, default=4096, help="dense shard size limit")
    parser.add_argument(
        "--ranks",
        type=int,
        default=1,
        help="write the expert pack of one of this many expert-parallel ranks "
        "(docs/distributed.md); the dense weights are written whole",
    )
    parser.add_argument("--rank", type=int, default=0, help="the rank whose experts to write")
    parser.add_argument(
        "--pack-file-mb", type=float, default=4096, help="expert pack file size limit"
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=min(4, os.cpu_count() or 1),
        help="pack files written (and files verified) in parallel",
    )
    parser.add_argument(
        "--chunk-mb",
        type=float,
        default=256,
        help="source bytes quantized or copied at once (bounds memory)",
    )
    return parser


def main(argv=None) -> int:
    a = setup_arg_parser().parse_args(argv)
    mb = 1 << 20
    settings = Settings(
        a.dense_bits,
        a.group_size,
        int(a.shard_mb * mb),
        int(a.pack_file_mb * mb),
        a.ranks,
        a.rank,
        a.expert_bits,
    )
    try:
        convert(
            a.hf_path,
            a.out,
            settings,
            a.verify,
            a.workers,
            max(1, int(a.chunk_mb * mb)),
            dry_run=a.dry_run,
        )
    except (CheckpointError, ConfigError, FileNotFoundError) as e:
        print(f"kimi_k3.convert: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nkimi_k3.convert: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    return 0

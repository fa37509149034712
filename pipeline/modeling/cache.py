"""Caches of what does not change while the backbone is frozen.

``PrefixCache`` (disk): per example, the encoder output and the hidden state entering the first adapted decoder layer
(:class:`pipeline.modeling.model.Prefix`); they depend only on the backbone, the example's token ids and k, so every
step, validation and experiment reuses them. ``<root>/<key>/<entry>.safetensors``: the key hashes the backbone
fingerprint, max lengths, k, dtype and format version; the entry the example id and its token ids (so edited text
never hits a stale entry). Entries are trimmed to the example's lengths, evicted least recently used (mtime) beyond
``max_bytes``, written to a temp file and renamed (concurrent workers see a whole file or none), and carry the
sha256 of their tensors: a damaged entry is logged, deleted and recomputed. A relative cache_dir is under the project
root (shared_model's), so DVC's temporary experiment copies share one cache. float16/bfloat16 entries are
not exact. Once read (or computed), an entry stays resident on the model's device for the cache object's life
(pipeline.training.shared_model keeps one per process), so later rounds neither read, hash nor touch it again (its
recency is kept in memory: eviction by this process weighs it); an entry evicted from disk leaves memory too, so
the resident entries never exceed the disk budget."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.nn.utils.rnn import pad_sequence

from pipeline.common import atomic
from pipeline.modeling.batching import IGNORE_INDEX, Batch
from pipeline.modeling.model import AdapterSummarizer, Prefix

FORMAT_VERSION = 2  # 2: entries carry a checksum (version-1 entries sit under another key and age out)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CHECKSUM_KEY = "sha256"
log = logging.getLogger(__name__)


def tensors_sha256(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(str((tuple(t.shape), str(t.dtype))).encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().data)  # no copy; uint8: numpy has no bf16
    return h.hexdigest()


def _stat(path: Path) -> os.stat_result | None:
    """None: gone since the directory was listed (another process sharing the cache evicted it)."""
    with contextlib.suppress(OSError):
        return path.stat()


def _sha(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


class PrefixCache:
    def __init__(self, root: str | os.PathLike, fingerprint: str, cfg, dtype: str = "float32", max_bytes=4 * 2**30):
        """A cache under ``root`` for the backbone ``fingerprint`` names and the model settings ``cfg`` (its max
        lengths and ``top_k``)."""
        self.root = Path(root)
        self.dtype = DTYPES[dtype]
        self.max_bytes = int(max_bytes)
        key = {
            "fingerprint": fingerprint,
            "max_source_length": cfg.max_source_length,
            "max_target_length": cfg.max_target_length,
            "top_k": cfg.top_k,
            "dtype": dtype,
            "format_version": FORMAT_VERSION,
        }
        self.key = _sha(*key.values())[:20]
        self.dir = self.root / self.key
        self.dir.mkdir(parents=True, exist_ok=True)
        if not (self.dir / "key.json").exists():  # atomic: another worker may create the same key at once
            atomic.write_json(self.dir / "key.json", key, indent=1)
        self.stats = {"hits": 0, "misses": 0, "evicted": 0, "refused": 0, "damaged": 0}
        self.resident: dict[Path, tuple[torch.Tensor, torch.Tensor]] = {}  # entry file -> its tensors, on device
        self._paths: dict[tuple[str, bytes, bytes], Path] = {}  # (example id, its token ids' bytes) -> entry file
        self._used: dict[Path, float] = {}  # a resident entry's last use (its file is not touched on every use)
        self.size_bytes = sum(st.st_size for p in self.root.glob("*/*.safetensors") if (st := _stat(p)))  # every key

    def prefix_for(self, model: AdapterSummarizer, batch: Batch) -> Prefix:
        """The batch's prefix, padded like the batch; missing entries are computed (one backbone pass) and stored."""
        src_len = batch.attention_mask.sum(dim=1).tolist()
        tgt_len = (batch.labels != IGNORE_INDEX).sum(dim=1).tolist()
        paths: list[Path] = []
        entries: list[tuple[torch.Tensor, torch.Tensor] | None] = []  # None: a miss, computed below
        now = time.time()
        for i, eid in enumerate(batch.example_ids):
            src_ids, dec_ids = batch.input_ids[i, : src_len[i]], batch.decoder_input_ids[i, : tgt_len[i]]
            # an entry's name is hashed once per process: every later micro-batch finds it by the ids' bytes
            ids = (eid, src_ids.numpy().tobytes(), dec_ids.numpy().tobytes())
            if (path := self._paths.get(ids)) is None:
                name = _sha(eid, src_ids.tolist(), dec_ids.tolist())[:32]
                path = self._paths[ids] = self.dir / f"{name}.safetensors"
            paths.append(path)
            if (entry := self.resident.get(path)) is None and (loaded := self._load(path)) is not None:
                entry = self.resident[path] = tuple(t.to(model.device) for t in loaded)
            entries.append(entry)
            if entry is not None:
                self.stats["hits"] += 1
                self._used[path] = now
        if missing := [i for i, entry in enumerate(entries) if entry is None]:
            self.stats["misses"] += len(missing)
            computed = model.compute_prefix(batch.select(missing))
            for j, i in enumerate(missing):
                enc = computed.encoder_hidden[j, : src_len[i]].to("cpu", self.dtype).contiguous()
                dec = computed.decoder_hidden[j, : tgt_len[i]].to("cpu", self.dtype).contiguous()
                entries[i] = (enc, dec)
                if self._store(paths[i], enc, dec):
                    self.resident[paths[i]] = entries[i] = (enc.to(model.device), dec.to(model.device))

        # right-padded with zeros to the batch's widths (one call per tensor: no Python loop of copies)
        hidden = []
        for k, width in enumerate((batch.input_ids.shape[1], batch.labels.shape[1])):
            h = pad_sequence([entry[k].to(model.device, torch.float32) for entry in entries], batch_first=True)
            hidden.append(torch.nn.functional.pad(h, (0, 0, 0, width - h.shape[1])))
        return Prefix.of(batch, *hidden)

    def _load(self, path: Path) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The entry's tensors (None: not there, or damaged: then logged, deleted and recomputed by the caller)."""
        try:
            with safe_open(str(path), framework="pt") as f:
                expected = (f.metadata() or {}).get(CHECKSUM_KEY)
                enc, dec = f.get_tensor("encoder_hidden"), f.get_tensor("decoder_hidden")
        except FileNotFoundError:
            return None  # not computed yet, or evicted meanwhile
        except Exception as exc:  # noqa: BLE001 -- safetensors raises its own error types for a bad header
            why = f"unreadable ({type(exc).__name__}: {' '.join(str(exc).split())[:120]})"
        else:
            if expected is not None and tensors_sha256(enc, dec) == expected:
                with contextlib.suppress(FileNotFoundError):
                    os.utime(path)  # LRU: a hit makes the entry recent
                return enc, dec
            why = "no checksum in its metadata" if expected is None else "tensor bytes do not match the recorded sha256"
        log.warning("prefix cache: damaged entry %s: %s; recomputing it", path, why)
        self.stats["damaged"] += 1
        self._remove(path)
        return None

    def _remove(self, path: Path) -> int:
        """Delete an entry, from disk and memory, and uncount its file; the bytes freed (0: gone already)."""
        self.resident.pop(path, None)
        try:
            size = path.stat().st_size
            path.unlink()
        except OSError:
            return 0
        self.size_bytes -= size
        return size

    def _store(self, path: Path, enc: torch.Tensor, dec: torch.Tensor) -> bool:
        """Write the entry (False: refused, larger than the whole budget)."""
        fd, tmp = tempfile.mkstemp(dir=self.dir, suffix=".tmp")
        os.close(fd)
        try:
            save_file(
                {"encoder_hidden": enc, "decoder_hidden": dec}, tmp, metadata={CHECKSUM_KEY: tensors_sha256(enc, dec)}
            )
            size = os.path.getsize(tmp)
            if size > self.max_bytes:
                self.stats["refused"] += 1
                return False
            if path in self.resident:  # written by this call already (a stacked batch repeats an example): replaced
                self._remove(path)
            if self.size_bytes + size > self.max_bytes:
                self._evict(self.size_bytes + size - self.max_bytes)
            os.replace(tmp, path)
            self.size_bytes += size
            return True
        finally:
            Path(tmp).unlink(missing_ok=True)  # refused, or failed: no temporary is left

    def _evict(self, need: int) -> None:
        """Least recently used first: by the files' mtime, or this process's last use of a resident entry."""
        files = [
            (max(st.st_mtime, self._used.get(p, 0.0)), p) for p in self.root.glob("*/*.safetensors") if (st := _stat(p))
        ]
        for _, p in sorted(files, key=lambda f: f[0]):  # stable: listing order among equal times
            if need <= 0:
                break
            if size := self._remove(p):
                need -= size
                self.stats["evicted"] += 1

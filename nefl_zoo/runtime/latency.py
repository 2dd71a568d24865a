"""Latency measured on the device: the table ``python -m nefl_zoo.runtime bench`` writes and
``select --latency-table`` reads, so a host can choose a tier for a device it never ran on.

numpy, onnxruntime, pydantic and the standard library only. The file (JSON; every field
required, every number finite and within :mod:`nefl_zoo.bounds`: latencies up to a day, batches
up to 65536, runs and warmup up to 100000, threads up to 1024)::

    schema           "nefl-zoo-latency-table"
    version          1
    model            the manifest's model
    manifest_sha256  sha256 of the manifest.json bytes the table was measured for
    machine          {processor, platform, cpu_count, onnxruntime, provider} of the device
    threads          onnxruntime intra-op threads (null: its default, one per physical core)
    runs, warmup     timed rounds and untimed rounds before them
    entries[]        label, sha256 (of the tier file timed), batch, median_ms, p95_ms, runs

A table applies to a manifest entry by its label *and* file: :meth:`LatencyTable.check_matches`
refuses a table of another model, without an entry the caller needs at the batch, or whose
entry was timed on another file than the manifest's (a re-exported tier). ``manifest_sha256``
only records which manifest was measured: a manifest rewritten with the same tier files (say,
accuracies re-measured) still matches.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import platform
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Callable, Hashable, Literal, Mapping, Sequence, TypeVar

import numpy as np
import onnxruntime as ort
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from ..bounds import MAX_BATCH, MAX_MS, MAX_RUNS, MAX_THREADS, MIN_MS, number
from ..manifest import Machine, Manifest
from ..userfiles import MISSING_KEY, FileError, field_error, format_validation_error, read_json
from .session import CPU_PROVIDER

if TYPE_CHECKING:
    from .tiers import TierRuntime

SCHEMA = "nefl-zoo-latency-table"
VERSION = 1
PERCENTILES = ("median", "p95")
BENCH = "python -m nefl_zoo.runtime bench"
K = TypeVar("K", bound=Hashable)


class LatencyTableError(FileError):
    """A latency table that cannot be used, as one line naming the file and field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


Milliseconds = Annotated[float, Field(ge=MIN_MS, le=MAX_MS)]  # what the adaptive policy takes as an estimate
Threads = Annotated[int, Field(ge=1, le=MAX_THREADS)]
Batch = Annotated[int, Field(ge=1, le=MAX_BATCH)]
Runs = Annotated[int, Field(ge=1, le=MAX_RUNS)]


class LatencyEntry(_Strict):
    """One entry's wall time per ``session.run`` of a batch of ``batch`` inputs, over ``runs`` runs."""

    label: str = Field(min_length=1)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="of the tier file timed")
    batch: Batch
    median_ms: Milliseconds
    p95_ms: Milliseconds
    runs: Runs

    @model_validator(mode="after")
    def _ordered(self) -> "LatencyEntry":
        if self.p95_ms < self.median_ms:
            raise field_error("p95_ms", f"{self.p95_ms:g} is below median_ms {self.median_ms:g}")
        return self


class LatencyTable(_Strict):
    """Every entry's latency on one device at each batch measured (see the module docstring).

    What ``python -m nefl_zoo.runtime bench`` writes, and ``select --latency-table`` reads.

    Attributes:
        schema_name: the file's format, ``nefl-zoo-latency-table`` (the key ``schema``).
        version: the format's version.
        model: the model the export is of.
        manifest_sha256: the SHA-256 of the manifest it was measured on.
        machine: the device.
        threads: onnxruntime's intra-op threads (``None``: its default).
        runs: timed rounds.
        warmup: untimed rounds before them.
        entries: each entry's median and 95th-percentile latency at each batch.
    """

    schema_name: Literal["nefl-zoo-latency-table"] = Field(alias="schema")
    version: Literal[1]
    model: str
    manifest_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    machine: Machine
    threads: Threads | None
    runs: Runs
    warmup: Annotated[int, Field(ge=0, le=MAX_RUNS)]
    entries: list[LatencyEntry] = Field(min_length=1)
    _source: str = PrivateAttr("the latency table")  # the file it was read from, for errors

    @model_validator(mode="after")
    def _unique(self) -> "LatencyTable":
        seen: set[tuple[str, int]] = set()
        for i, entry in enumerate(self.entries):
            if (entry.label, entry.batch) in seen:
                raise field_error(f"entries[{i}]", f"a second entry for {entry.label} at batch {entry.batch}")
            seen.add((entry.label, entry.batch))
        return self

    @property
    def measured_on(self) -> str:
        """Where the table was measured, for a selection's reason: ``on CPU (device.json)``."""
        return f"on {self.machine.processor} ({Path(self._source).name})"

    def for_batch(self, batch: int, percentile: str = "median") -> dict[str, float]:
        """Label -> ms at ``batch`` (``percentile``: "median" or "p95").

        Args:
            batch: the batch size.
            percentile: ``median`` or ``p95``.

        Returns:
            Each entry's latency in milliseconds, by label.

        Raises:
            ValueError: another percentile.
            LatencyTableError: no entry was measured at that batch (naming the file).
        """
        if percentile not in PERCENTILES:
            raise ValueError(f"percentile: expected median or p95, got {percentile!r}")
        out = {e.label: e.median_ms if percentile == "median" else e.p95_ms for e in self.entries if e.batch == batch}
        if not out:
            have = ", ".join(map(str, sorted({e.batch for e in self.entries})))
            raise LatencyTableError(
                self._source, "entries", f"nothing measured at batch {batch} (batches: {have}; run `{BENCH} --batch {batch}`)"
            )
        return out

    def check_matches(self, manifest: Manifest, batch: int, labels: Sequence[str] | None = None) -> None:
        """:class:`LatencyTableError` unless the table holds, at ``batch``, each of ``labels``
        (default: every entry of ``manifest``) timed on the manifest's file of it.

        Args:
            manifest: the export's manifest.
            batch: the batch size.
            labels: the entries to check (default: every entry).

        Raises:
            LatencyTableError: another model, a missing entry, or an entry timed on a file
                the manifest no longer lists.
        """
        if self.model != manifest.model:
            raise LatencyTableError(
                self._source, "model", f"{self.model!r}, but the manifest is of {manifest.model!r} (a table of another package)"
            )
        timed = {(e.label, e.batch): (i, e) for i, e in enumerate(self.entries)}
        for label in labels or [t.label for t in manifest.tiers]:
            sha = manifest.tier(label).sha256
            if (label, batch) not in timed:
                raise LatencyTableError(
                    self._source, "entries", f"no entry for {label} at batch {batch} (run `{BENCH} --batch {batch}` on the device)"
                )
            i, entry = timed[(label, batch)]
            if entry.sha256 != sha:
                raise LatencyTableError(
                    self._source, f"entries[{i}].sha256",
                    f"{label} was timed on another file than the manifest's (re-exported since?); run `{BENCH}` again",
                )

    def to_json(self) -> str:
        """The table as the JSON of its file.

        Returns:
            The JSON text.
        """
        return self.model_dump_json(indent=2, by_alias=True)

    def save(self, path: str | Path) -> None:
        """Write the table to ``path`` atomically (a temporary file beside it, then renamed).

        Args:
            path: the file to write.

        Raises:
            OSError: naming ``path`` (:func:`check_writable` says why before anything is timed).
        """
        check_writable(path)
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "x", encoding="utf-8") as f:
                f.write(self.to_json() + "\n")
                f.flush()
                os.fsync(f.fileno())  # on the disk before it replaces the old table
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise OSError(exc.errno, exc.strerror, str(path)) from None  # what was given, not the temporary file
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self._source = str(path)


def check_writable(path: str | Path) -> None:
    """``ValueError`` naming ``path`` as given when a table cannot be written there: a
    folder, or in a folder that does not exist."""
    given, path = str(path), Path(path)
    if path.is_dir():
        raise ValueError(f"{given}: is a folder; give the table's file name (e.g. {path / 'latency.json'})")
    if not path.parent.is_dir():
        raise ValueError(f"{given}: its folder {path.parent} does not exist")


def parse_latency_table(data: object, source: str) -> LatencyTable:
    """Validate loaded table data; :class:`LatencyTableError` names the first bad field."""
    if not isinstance(data, dict):
        raise LatencyTableError(source, "", f"expected a JSON object, got {type(data).__name__}")
    schema = data.get("schema")
    if schema != SCHEMA:
        got = MISSING_KEY if schema is None else f"{schema!r}, not {SCHEMA!r}"
        raise LatencyTableError(source, "schema", f"{got} (not a latency table; `{BENCH} PACKAGE --out FILE` writes one)")
    if data.get("version") != VERSION:
        raise LatencyTableError(
            source, "version", f"unsupported version {data.get('version')!r} (this nefl-zoo reads {VERSION}; run the bench again)"
        )
    try:
        table = LatencyTable.model_validate(data)
    except ValidationError as exc:
        raise format_validation_error(source, exc, LatencyTableError) from None
    table._source = source
    return table


def load_latency_table(path: str | Path) -> LatencyTable:
    """Read and validate a latency table file.

    Args:
        path: the file.

    Returns:
        The table.

    Raises:
        LatencyTableError: an unreadable or invalid file, in one line.
    """
    return parse_latency_table(read_json(path, LatencyTableError, what="the latency table"), str(path))


def machine_description(provider: str = CPU_PROVIDER) -> Machine:
    """The CPU, OS and onnxruntime version latencies are measured with.

    Args:
        provider: the execution provider the latencies are measured on.

    Returns:
        This machine's description.
    """
    return Machine(
        processor=platform.processor() or platform.machine(),
        platform=platform.platform(),
        cpu_count=os.cpu_count() or 1,
        onnxruntime=ort.__version__,
        provider=provider,
    )


def median_p95(times: Sequence[float]) -> tuple[float, float]:
    """The median of ``times`` and their 95th percentile (nearest rank: the smallest time
    that at least 95% of them do not exceed)."""
    ordered = sorted(times)
    return statistics.median(ordered), ordered[math.ceil(0.95 * len(ordered)) - 1]


def interleaved_times_ms(
    fns: Mapping[K, Callable[[], object]], rounds: int, warmup_rounds: int = 0,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[K, list[float]]:
    """The ms of every call of each of ``fns`` over ``rounds`` rounds that call every function
    once in turn (after ``warmup_rounds`` untimed rounds), so that a change of machine load
    hits all of them alike; ``clock`` returns seconds."""
    times: dict[K, list[float]] = {key: [] for key in fns}
    for round_ in range(warmup_rounds + rounds):
        for key, fn in fns.items():
            start = clock()
            fn()
            if round_ >= warmup_rounds:
                times[key].append((clock() - start) * 1e3)
    return times


def check_counts(batches: Sequence[int], runs: int, warmup: int, threads: int | None = None, prefix: str = "") -> None:
    """``ValueError`` naming (after ``prefix``: ``--`` for options) the first count of a
    benchmark out of its bounds: each batch in 1..65536 (at least one, each once), ``runs`` in
    1..100000, ``warmup`` in 0..100000, ``threads`` (``None``: onnxruntime's default) in 1..1024."""
    number(f"{prefix}runs", runs, 1, MAX_RUNS, integer=True)
    number(f"{prefix}warmup", warmup, 0, MAX_RUNS, integer=True)
    if threads is not None:
        number(f"{prefix}threads", threads, 1, MAX_THREADS, integer=True)
    if not batches:
        raise ValueError(f"{prefix}batch: give at least one batch size")
    for batch in batches:
        number(f"{prefix}batch", batch, 1, MAX_BATCH, integer=True)
    if len(set(batches)) != len(batches):
        raise ValueError(f"{prefix}batch: each size once, got {list(batches)}")


def measure_latency_table(
    runtime: TierRuntime, batches: Sequence[int], runs: int, warmup: int, labels: Sequence[str] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> LatencyTable:
    """Time each of ``labels`` (default: every entry of the manifest) at each of ``batches``
    on a seeded random batch, the entries interleaved round by round (``warmup`` untimed
    rounds, then ``runs`` timed ones).

    Args:
        runtime: the export's runtime.
        batches: the batch sizes.
        runs: timed rounds.
        warmup: untimed rounds before them.
        labels: the entries to time (default: every entry).
        clock: seconds, monotonic.

    Returns:
        The table.

    Raises:
        ValueError: a bad count, or a batch the export cannot take or that cannot fit in
            memory; raised before anything is timed.
    """
    check_counts(batches, runs, warmup, runtime.threads)
    chosen = [runtime.resolve(label) for label in labels] if labels else [t.label for t in runtime.manifest.tiers]
    fixed, spec = runtime.manifest.input.batch, runtime.manifest.input
    for batch in batches:
        if fixed is not None and batch != fixed:
            raise ValueError(f"this export has a fixed batch of {fixed}, got --batch {batch}")
        runtime.check_memory(batch, chosen)
    sessions = {label: runtime.session(label) for label in chosen}
    rng = np.random.default_rng(0)
    entries = []
    for batch in batches:
        feed = {spec.name: rng.standard_normal((batch, *spec.shape), dtype=np.float32)}
        calls = {label: functools.partial(session.run, None, feed) for label, session in sessions.items()}
        for label, times in interleaved_times_ms(calls, runs, warmup, clock).items():
            median, p95 = median_p95(times)
            sha = runtime.manifest.tier(label).sha256
            entries.append(LatencyEntry(label=label, sha256=sha, batch=batch, median_ms=median, p95_ms=p95, runs=runs))
    return LatencyTable(
        schema=SCHEMA, version=VERSION, model=runtime.manifest.model,
        manifest_sha256=hashlib.sha256(runtime.manifest_path.read_bytes()).hexdigest(),
        machine=machine_description(next(iter(sessions.values())).get_providers()[0]),
        threads=runtime.threads, runs=runs, warmup=warmup, entries=entries,
    )

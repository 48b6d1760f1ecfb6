"""Start a real Triton Inference Server without Docker: the one in the `nvidia-pytriton` wheel (here),
or an installed one (the NGC image: `tritonserver=` names its binary).

The wheel carries a `tritonserver` binary, the Python backend and one backend stub per Python
version (docs/design.md, "Triton without Docker"). To run it we lay out a backend directory holding
the stub for the running interpreter, put this virtual environment first on PATH (the stub runs the
first `python3` it finds there and takes its packages from that environment; it ignores PYTHONPATH),
put the wheel's libraries and this interpreter's libpython on LD_LIBRARY_PATH (without the latter the
stub loads the system libpython against another stdlib), and load the models whose backends exist.

Every server started here serves a private copy of its repository (in its own 0700 work directory)
with Triton polling it: the supervisor (serving/host/supervisor.py) reloads a model by rewriting that
copy's config, so nothing needs Triton's model-repository API, and its administrative APIs (model
repository, shared memory, logging, trace) are closed over HTTP and gRPC to every request: no key
exists, on the command line or anywhere else. Ports are checked before the start: a port another
process holds is named with that process, and never read as if it were ours. Each server dies with
the process that started it and leaves no process, shared-memory region or folder behind
(serving/host/process.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import importlib.util
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from contract import files
from contract.deployment import FEW_SESSIONS
from contract.names import SESSION_MODEL
from serving.host.process import ManagedProcess, ProcessStartError, remove_unmapped_shm

log = logging.getLogger(__name__)

SHM_PREFIX = "triton_python_backend_shm_region_"
STUB_NAME = "triton_python_backend_stub"  # the Python backend's model process, one per model instance
# Backends the NGC image has and the wheel does not: models using them load only there.
_PLATFORM_BACKENDS = {"onnxruntime_onnx": "onnxruntime", "tensorrt_plan": "tensorrt", "pytorch_libtorch": "pytorch"}


# Triton's count while its exit timeout runs: "Model 'sessions' (version 1) has 1 in-flight inferences"
_IN_FLIGHT = re.compile(r"Model '([\w.-]+)' \(version \d+\) has (\d+) in-flight")
# Triton's shutdown counts (server.cc) and unloads: see `Shutdown`; a line is matched only once written whole
_SIGNAL = "Signal ("
_VERSIONS_IN_FLIGHT = re.compile(r'Timeout \d+: Found (\d+) model versions that have in-flight inferences"')
_LIVE = re.compile(r'Timeout \d+: Found (\d+) live models and (\d+) in-flight non-inference requests"')
_UNLOADED = re.compile(r"successfully unloaded '([\w.-]+)' version \d+\"")
# What each python model says once loaded (serving/triton/models): its runner and its capacity.
_MODEL_SAYS = re.compile(r'\] "?(?P<model>[\w.-]+): runner (?P<said>.*?)"?$')
_CAPACITY = re.compile(r"= (?P<sequences>\d+) sequences of up to")


def serving_lines(log_text: str) -> list[str]:
    """The console lines telling what each model runs on and how many sessions it holds, read from
    the lines the models log at load; a warning when the KV budget holds only a few sessions."""
    lines = []
    for match in map(_MODEL_SAYS.search, log_text.splitlines()):
        if match is None:
            continue
        first, *rest = match["said"].split("; ")
        lines += [f"{match['model']:<15} {first}", *(f"{'':<15} {part}" for part in rest)]
        capacity = _CAPACITY.search(match["said"])
        if capacity and int(capacity["sequences"]) < FEW_SESSIONS:
            lines.append(
                f"{'':<15} warning: only {capacity['sequences']} sessions fit at once; "
                "raise --kv-cache-mib to hold more"
            )
    return lines


class TritonStartError(ProcessStartError):
    """Triton did not become ready; the message ends with the tail of its log."""


class PortInUseError(TritonStartError):
    """A port the server needs is held by another process (named in the message)."""


class TritonCrashedStarting(TritonStartError):
    """Triton died by a signal before it was ready, its log empty or cut short: a crash of its own
    (2.51 segfaulted once at start in CI with an empty log, among a dozen servers starting at once),
    not a refusal it explains; a fresh start is tried."""


START_ATTEMPTS = 2


# The APIs that change a running server, closed to every request: Triton admits them only with a
# header of this name, which no request can carry. An HTTP/1.1 field name ends at its first colon,
# and gRPC's HTTP/2 parser resets a stream whose header name holds one (measured on 2.51, which
# admits a raw HTTP/2 request with a header it can parse). So what the command line shows opens
# nothing, and nothing else does either.
RESTRICTED_APIS = "model-repository,shared-memory,logging,trace"
CLOSED_HEADER = "admin:closed"
# A config parameter no model reads: changing it in the private repository makes Triton load the
# model anew (Triton 2.51 skips a load whose files did not change, and one whose config changes in
# nothing but the instances keeps the instances, the dead one included)
RELOAD_PARAMETER = "supervisor_reload"
POLL_SECONDS = 1  # how often Triton looks for changed configs in its private repository
# on SIGINT Triton serves what is in flight (open sessions included) and unloads its models for this long at most
EXIT_TIMEOUT_S = 5


@dataclasses.dataclass(frozen=True)
class TritonInstall:
    """Where a tritonserver binary and its backends are, and the environment it runs in."""

    binary: Path
    backends: Path
    env: dict[str, str]
    gpu_metrics: bool  # the wheel's build has no GPU metrics


def bundled_install(work_dir: Path) -> TritonInstall:
    """The wheel's tritonserver, its backends completed by this interpreter's stub in `work_dir`."""
    bundle = bundled_triton()
    return TritonInstall(
        bundle / "bin" / "tritonserver", backend_directory(bundle, work_dir), server_environment(bundle), False
    )


def system_install(binary: Path) -> TritonInstall:
    """An installed tritonserver (the NGC image's /opt/tritonserver/bin/tritonserver) with its own
    backends beside it and the environment as it is."""
    binary = Path(binary)
    if not binary.is_file():
        raise TritonStartError(f"no tritonserver binary at {binary}")
    env = dict(os.environ)
    env.update({key: value for key, value in MALLOC_SETTINGS.items() if key not in env})
    return TritonInstall(binary, binary.parent.parent / "backends", env, True)


def bundled_triton() -> Path:
    """The `tritonserver` directory inside the installed nvidia-pytriton wheel."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise TritonStartError("nvidia-pytriton is not installed; run `make install`")
    root = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
    if not (root / "bin" / "tritonserver").is_file():
        raise TritonStartError(f"no tritonserver binary under {root}")
    return root


def stub_for_this_python(bundle: Path) -> Path:
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = bundle / "python_backend_stubs" / version / STUB_NAME
    if not stub.is_file():
        available = sorted(p.name for p in (bundle / "python_backend_stubs").iterdir())
        raise TritonStartError(f"the wheel has no Python backend stub for Python {version}; it has {available}")
    return stub


def backend_directory(bundle: Path, work_dir: Path) -> Path:
    """`backends/` with every bundled backend, the Python one completed by this interpreter's stub."""
    backends = work_dir / "backends"
    shutil.copytree(bundle / "backends", backends, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(stub_for_this_python(bundle), backends / "python" / STUB_NAME)
    return backends


def server_environment(bundle: Path) -> dict[str, str]:
    libraries = [str(bundle.parent.parent / "nvidia_pytriton.libs"), sysconfig.get_config_var("LIBDIR") or ""]
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in [*libraries, env.get("LD_LIBRARY_PATH", "")] if p)
    # the stub runs the first python3 on PATH (and needs bash): this environment's first
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), "/usr/local/bin", "/usr/bin", "/bin"])
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(files.PROJECT_ROOT), env.get("PYTHONPATH", "")] if p)
    env.update({key: value for key, value in MALLOC_SETTINGS.items() if key not in env})
    return env


# glibc raises its mmap threshold after big buffers are freed and then keeps later ones of that size
# on the heap, which it never gives back: a stub's memory grew from load run to load run (measured:
# 1066, 1057, 1217 MiB of anonymous memory over three identical runs; with a fixed threshold 570,
# 572, 574). Fixed thresholds keep big buffers mmapped and returned when freed.
MALLOC_SETTINGS = {"MALLOC_MMAP_THRESHOLD_": "262144", "MALLOC_TRIM_THRESHOLD_": "1048576"}


def model_backend(model_dir: Path) -> str | None:
    """The backend a model's config.pbtxt names (or implies through its platform)."""
    from serving.triton.config import TRITON_CONFIG_FILENAME, parse

    config_path = model_dir / TRITON_CONFIG_FILENAME
    if not config_path.is_file():
        return None
    config = parse(config_path.read_text())
    return config.backend or _PLATFORM_BACKENDS.get(config.platform, config.platform) or None


def loadable_models(repository: Path, backends: Path) -> tuple[list[str], dict[str, str]]:
    """(models whose backend exists here, {model: why it is skipped})."""
    available = {p.name for p in backends.iterdir() if p.is_dir()}
    loadable, skipped = [], {}
    for model_dir in sorted(p for p in repository.iterdir() if p.is_dir()):
        backend = model_backend(model_dir)
        if backend is None:
            continue
        if backend in available:
            loadable.append(model_dir.name)
        else:
            skipped[model_dir.name] = f"backend '{backend}' is not in this Triton build (it is in the NGC image)"
    return loadable, skipped


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct free ports: each socket stays bound until all are picked (two `free_port()` in a row can
    answer the same port, and the server given it twice then cannot listen)."""
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(count)]
        for sock in sockets:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]


class TritonServer(ManagedProcess):
    """A running tritonserver process; stop() (or leaving the `with` block) shuts it down."""

    name = "tritonserver"

    def __init__(
        self,
        process: subprocess.Popen,
        host: str,
        ports: dict[str, int],
        models: list[str],
        log_path: Path,
        work_dir: Path,
        owns_log: bool,
    ) -> None:
        super().__init__(process, work_dir, log_path)
        self.host, self.ports, self.models, self._owns_log = host, ports, models, owns_log
        self.reloads = 0  # models loaded anew by `reload`

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.ports['http']}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.ports['grpc']}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.ports['metrics']}/metrics"

    @property
    def repository(self) -> Path:
        """The private copy Triton serves and polls."""
        return self.work_dir / "repository"

    @property
    def shm_prefix(self) -> str:
        """The prefix of this server's shared-memory regions (the Python backend's, one per stub)."""
        return shm_prefix(self.work_dir)

    def reload(self, models: Sequence[str], timeout: float = 30.0) -> None:
        """Load `models` anew and return once Triton serves them: their config in the private
        repository rewritten with one parameter changed, which Triton's next poll (within
        POLL_SECONDS) loads as a new model, swapped in once ready. TimeoutError after `timeout`."""
        from serving.triton.config import TRITON_CONFIG_FILENAME, parse, to_text

        self.reloads += 1
        generation = str(self.reloads)
        for model in models:
            path = self.repository / model / TRITON_CONFIG_FILENAME
            config = parse(path.read_text())
            config.parameters[RELOAD_PARAMETER].string_value = generation
            scratch = self.work_dir / f"{model}.{TRITON_CONFIG_FILENAME}"
            scratch.write_text(to_text(config))
            scratch.replace(path)  # Triton's poll never reads half a file
        deadline = time.monotonic() + timeout
        while (pending := [m for m in models if self._served_generation(m) != generation]) and self.is_running():
            if time.monotonic() > deadline:
                raise TimeoutError(f"Triton did not load {', '.join(pending)} again within {timeout:g} s")
            time.sleep(0.1)

    def _served_generation(self, model: str) -> str | None:
        """The reload parameter of the config Triton serves `model` with (that of its ready version)."""
        url = f"http://{self.http_url}/v2/models/{model}/config"
        with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(url, timeout=5) as response:
            parameters = json.load(response).get("parameters", {})
            return parameters.get(RELOAD_PARAMETER, {}).get("string_value")
        return None

    def stop(self, timeout: float = 30.0, keep_log: bool = False, drain: bool = True) -> int | None:
        """Graceful: SIGINT to Triton (it serves what is in flight, open sessions included, then unloads
        the models, which ends their stubs), then SIGTERM, then SIGKILL of the whole process group; ended
        at once when what it still waits for will not come (`Shutdown.settled`): versions it replaced, or,
        with `drain=False` (the caller moved the sessions or gave them up), open sessions. Idempotent.
        Removes the server's shared-memory regions and work directory; the log is kept when asked or when
        Triton did not exit cleanly."""
        if not self.claim_stop():
            return self.process.returncode
        shutdown = Shutdown(self.log_path, _size(self.log_path), tuple(self.models), drain)
        graceful = self.end(((signal.SIGINT, timeout), (signal.SIGTERM, 10.0)), settled=shutdown.settled)
        if shutdown.ended:
            log.info("Triton ended without waiting for %s", shutdown.ended)
        open_sequences = self._open_sequences_at_exit()
        if open_sequences:
            log.warning(
                "Triton stopped with %d session(s) still open (a client that never sent their end); "
                "their KV caches were dropped",
                open_sequences,
            )
        exited_clean = self.process.returncode == 0 or self._held_a_replaced_model() or open_sequences > 0
        clean = bool(shutdown.ended) or (graceful and exited_clean)
        remove_unmapped_shm(self.shm_prefix)  # Triton removes them only on a clean exit
        self._cleanup(keep_log=keep_log or not clean)
        return self.process.returncode

    def running_stubs(self) -> set[str]:
        """The model instances ('<model>_0_0') whose stub process runs now (a zombie does not): Triton names
        each on its stub's command line."""
        import psutil

        running: set[str] = set()
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(self.process.pid).children():
                with contextlib.suppress(psutil.Error):
                    arguments = child.cmdline()
                    if child.status() != psutil.STATUS_ZOMBIE and arguments[0].endswith(STUB_NAME):
                        running.update(arguments[1:])
        return running

    def _held_a_replaced_model(self) -> bool:
        """Triton 2.51 never unloads a replaced version that a request reached while its stub was dead
        (or one that failed to load): a stop that `Shutdown.settled` did not end ends with Triton's exit
        timeout and exit code 1 (measured: the replaced model still live 60 s after the reload)."""
        return self.reloads > 0 and self.process.returncode == 1 and "Exit timeout expired" in self.log_tail(5)

    def _open_sequences_at_exit(self) -> int:
        """Sequences a client left open when Triton was stopped: its sequence batcher counts each as an
        in-flight inference of the session model, so the stop waits its exit timeout and exits 1
        (measured with one session of a direct gRPC client; the gateway ends its own sessions first).
        0 unless that, and only that, kept Triton from a clean exit."""
        if self.process.returncode != 1 or "Exit timeout expired" not in self.log_tail(5):
            return 0
        last_count = self.log_text().rpartition('] "Timeout ')[2]  # from the last count on
        held = dict(_IN_FLIGHT.findall(last_count))
        return sum(map(int, held.values())) if held and set(held) == {SESSION_MODEL} else 0

    def _cleanup(self, keep_log: bool) -> None:
        if keep_log:
            log.warning("Triton exited with %s; its log is kept at %s", self.process.returncode, self.log_path)
        if keep_log and self._owns_log:  # the log is in the work directory: keep it alone
            for entry in self.work_dir.iterdir():
                if entry != self.log_path:
                    shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
        else:
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def __enter__(self) -> TritonServer:
        return self


def _size(path: Path) -> int:
    with contextlib.suppress(OSError):
        return path.stat().st_size
    return 0


@dataclasses.dataclass
class Shutdown:
    """Triton's shutdown as its log tells it from `offset` on (server.cc, 2.51). Once a second it counts
    the model versions with in-flight inferences (each sequence its batcher holds is one) until none is
    left, then unloads every model and counts the live versions until none is, or its exit timeout
    passes. `settled()`: what it still counts will not end on its own, or is what the caller does not
    want waited for; `ended` then says what that was."""

    log_path: Path
    offset: int
    models: tuple[str, ...]
    drain: bool
    ended: str = ""

    def settled(self) -> bool:
        lines = self._lines()
        if not self.drain and (held := sessions_waited_for(lines)):
            self.ended = f"{held} open session(s), moved or given up by the caller"
            return True
        if holds_only_replaced_versions(lines, self.models):
            self.ended = "versions it replaced or failed to load, which Triton 2.51 may never unload"
            return True
        return False

    def _lines(self) -> list[str]:
        """The log from Triton's "Signal (n) received." on (a reload just before the stop logs unloads too)."""
        with contextlib.suppress(OSError), open(self.log_path, "rb") as log_file:
            log_file.seek(self.offset)
            text = log_file.read().decode(errors="replace")
            return text[text.find(_SIGNAL) :].splitlines() if _SIGNAL in text else []
        return []


def sessions_waited_for(lines: list[str]) -> int:
    """The sequences Triton's last in-flight count holds when they are all session models' (each an open
    session, served until its client ends it), else 0."""
    counts = [i for i, line in enumerate(lines) if _VERSIONS_IN_FLIGHT.search(line)]
    if not counts:
        return 0
    versions = int(_VERSIONS_IN_FLIGHT.search(lines[counts[-1]])[1])
    held = [found for line in lines[counts[-1] + 1 :] if (found := _IN_FLIGHT.search(line))]
    # a session model of any model set of the repository (sessions, fortunes_sessions)
    if versions == 0 or len(held) != versions or not all(m[1].endswith(SESSION_MODEL) for m in held):
        return 0
    return sum(int(m[2]) for m in held)


def holds_only_replaced_versions(lines: list[str], models: tuple[str, ...]) -> bool:
    """With nothing in flight, every model Triton serves has unloaded, and for one whole count since
    the last unload it still counts the same live versions: those it replaced after a stub died or
    failed to load anew, which Triton 2.51 never unloads (measured: still live 60 s on)."""
    unloads = [i for i, line in enumerate(lines) if _UNLOADED.search(line)]
    if not unloads or not set(models) <= {_UNLOADED.search(lines[i])[1] for i in unloads}:
        return False
    live = [(int(m[1]), int(m[2])) for line in lines[unloads[-1] + 1 :] if (m := _LIVE.search(line))]
    return len(live) >= 2 and live[-1] == live[-2] and live[-1][0] > 0 and live[-1][1] == 0


def shm_prefix(work_dir: Path) -> str:
    return f"{SHM_PREFIX}{work_dir.name}_"


def private_repository(source: Path, models: Sequence[str], into: Path) -> Path:
    """Triton's own copy of `models` from `source`: each config copied (the supervisor rewrites it to
    reload the model), each version folder made anew with links to its files (they are not copied).

    Triton polls this copy and loads a model again when anything in its folder changes. The stub
    writes model.py's bytecode beside it whatever PYTHONDONTWRITEBYTECODE says, and that new
    __pycache__ made Triton load both models twice at every start (measured); an empty file of that
    name in each version folder leaves Python nowhere to write (it skips the cache then)."""
    from serving.triton.config import TRITON_CONFIG_FILENAME

    for model in models:
        target = into / model
        target.mkdir(parents=True)
        for entry in (source / model).iterdir():
            if entry.name == TRITON_CONFIG_FILENAME:
                shutil.copyfile(entry, target / entry.name)
            elif entry.is_dir() and entry.name.isdigit():
                _link_version(entry, target / entry.name)
            else:
                (target / entry.name).symlink_to(entry)
    return into


def _link_version(source: Path, target: Path) -> None:
    target.mkdir()
    for entry in source.iterdir():
        if entry.name != PYCACHE:
            (target / entry.name).symlink_to(entry)
    (target / PYCACHE).touch()


PYCACHE = "__pycache__"


def _command(install: TritonInstall, repository: Path, host: str, ports: dict, work_dir: Path) -> list:
    closed = f"{RESTRICTED_APIS}:{CLOSED_HEADER}=never"
    return [
        str(install.binary),
        f"--model-repository={repository}",
        f"--backend-directory={install.backends}",
        # every model in the private repository, loaded again when its config there changes; the
        # load and unload APIs are refused in this mode whatever the header
        "--model-control-mode=poll",
        f"--repository-poll-secs={POLL_SECONDS}",
        f"--http-port={ports['http']}",
        f"--grpc-port={ports['grpc']}",
        f"--metrics-port={ports['metrics']}",
        f"--http-address={host}",
        f"--grpc-address={host}",
        f"--metrics-address={host}",
        f"--http-restricted-api={closed}",
        f"--grpc-restricted-protocol={closed}",
        f"--allow-gpu-metrics={str(install.gpu_metrics).lower()}",
        # every config is generated whole (serving/triton/config.py), so Triton serves the same config
        # without its completion; with it the Python backend starts one more stub per model load, only to
        # ask model.py for a completion it does not define, then sleeps 1 s before ending that stub
        # (measured: a start of two models 1.8 s with it, 0.5 s without; of 18 models 8.5 s and 3.3 s)
        "--disable-auto-complete-config",
        # the CPU (and GPU) gauges' poll: Triton's exit joins the poll thread, which sleeps a whole
        # interval (default 2000 ms) between polls (measured: a stop 2.9 s at the default, 2.1 s at 250 ms)
        "--metrics-interval-ms=250",
        f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
        # a decode step's caches are megabytes: start the shared-memory region big enough for them
        "--backend-config=python,shm-default-byte-size=16777216",
        "--backend-config=python,shm-growth-byte-size=16777216",
        # this server's regions under a name of their own: a stop (or the next start, after a kill)
        # removes exactly those
        f"--backend-config=python,shm-region-prefix-name={shm_prefix(work_dir)}",
    ]


def check_ports_free(host: str, ports: dict[str, int]) -> None:
    """PortInUseError naming the port and the process that holds it, before anything starts (a
    server that fails to bind would otherwise look ready through the other server's answers)."""
    for what, port in ports.items():
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is no conflict
            try:
                sock.bind((host, port))
            except OSError as error:
                if error.errno != errno.EADDRINUSE:
                    raise TritonStartError(f"cannot bind the {what} port {port} on {host}: {error.strerror}") from None
                raise PortInUseError(
                    f"{what} port {port} on {host} is already in use ({port_holder(port)}): stop that process or "
                    f"choose another port (--{what}-port)"
                ) from None


def port_holder(port: int) -> str:
    """Who listens on `port`: "pid 123: tritonserver --model-repository ...", as far as we may see."""
    import psutil

    with contextlib.suppress(psutil.Error, OSError):
        for connection in psutil.net_connections(kind="inet"):
            if connection.status == psutil.CONN_LISTEN and connection.laddr and connection.laddr.port == port:
                if connection.pid is None:
                    return "a process of another user"
                with contextlib.suppress(psutil.Error):
                    command = " ".join(psutil.Process(connection.pid).cmdline())
                    return f"pid {connection.pid}: {command[:160]}"
                return f"pid {connection.pid}"
    return "by a process this user cannot see"


def _wait_ready(server: TritonServer, models: Sequence[str], timeout: float) -> None:
    pending = [f"http://{server.http_url}/v2/health/ready"]
    pending += [f"http://{server.http_url}/v2/models/{m}/ready" for m in models]

    def ready() -> bool:
        while pending and answers_200(pending[0]):
            pending.pop(0)
        return not pending

    # a start takes about a second: a look every 50 ms (a local GET) finds it ready within a few percent of that
    server.wait_ready(ready, timeout, TritonStartError, poll_s=0.05)


def answers_200(url: str) -> bool:
    """Whether a GET of `url` answers 200 within 2 s (a health endpoint: anything else is not ready)."""
    with contextlib.suppress(urllib.error.URLError, OSError), urllib.request.urlopen(url, timeout=2) as response:
        return response.status == 200
    return False


def start_triton(
    repository: str | Path,
    *,
    models: Sequence[str] | None = None,
    host: str = "127.0.0.1",
    http_port: int = 0,
    grpc_port: int = 0,
    metrics_port: int = 0,
    log_path: str | Path | None = None,
    ready_timeout: float = 180.0,
    tritonserver: str | Path | None = None,
) -> TritonServer:
    """Start Triton on `repository` and return once it and its models are ready.

    `models=None` loads every model whose backend this Triton build has (others are logged and
    skipped). A port of 0 picks a free one; a given port held by another process raises
    PortInUseError naming it. The log goes to `log_path` (appended; or a temporary file that is kept
    only if the server fails). `tritonserver` runs an installed server instead of the wheel's.
    """
    repository = Path(repository).resolve()
    if not repository.is_dir():
        raise TritonStartError(f"no model repository at {repository}")
    ports = {"http": http_port, "grpc": grpc_port, "metrics": metrics_port}
    check_ports_free(host, {name: port for name, port in ports.items() if port})
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            server = _start_once(repository, models, host, ports, log_path, ready_timeout, tritonserver)
            break
        except TritonCrashedStarting as crash:
            if attempt == START_ATTEMPTS:
                raise
            said = crash.args[0].partition(":")[0]
            log.warning("%s; starting it again (attempt %d of %d)", said, attempt + 1, START_ATTEMPTS)
    log.info(
        "Triton ready: HTTP %s, gRPC %s, metrics %s, models %s",
        server.http_url,
        server.grpc_url,
        server.metrics_url,
        server.models,
    )
    return server


def _start_once(
    repository: Path,
    models: Sequence[str] | None,
    host: str,
    ports: dict[str, int],
    log_path: str | Path | None,
    ready_timeout: float,
    tritonserver: str | Path | None,
) -> TritonServer:
    """One start: a fresh work directory, ports that are free now, the server ready or stopped."""
    missing = [name for name, port in ports.items() if not port]
    ports = ports | dict(zip(missing, free_ports(len(missing), host), strict=True))
    work_dir = Path(tempfile.mkdtemp(prefix="triton-"))
    try:
        install, models = _prepare(repository, models, tritonserver, work_dir)
    except BaseException:
        shutil.rmtree(work_dir, ignore_errors=True)
        raise
    owns_log = log_path is None
    log_path = Path(log_path) if log_path else work_dir / "triton.log"
    command = _command(install, work_dir / "repository", host, ports, work_dir)
    process = TritonServer.spawn(command, work_dir, output=log_path, env=install.env, shm_prefix=shm_prefix(work_dir))
    server = TritonServer(process, host, ports, list(models), log_path, work_dir, owns_log)
    try:
        _wait_ready(server, models, ready_timeout)
    except TritonStartError as error:
        server.stop(keep_log=True)
        if (process.returncode or 0) < 0:  # killed by a signal, not a refusal it explained in its log
            raise TritonCrashedStarting(*error.args) from None
        raise
    except BaseException:
        server.stop(keep_log=True)
        raise
    return server


def _prepare(
    repository: Path, models: Sequence[str] | None, tritonserver: str | Path | None, work_dir: Path
) -> tuple[TritonInstall, list[str]]:
    """The install to run and the models to load, laid out in `work_dir` (backends, private repository)."""
    install = system_install(Path(tritonserver)) if tritonserver else bundled_install(work_dir)
    if models is None:
        models, skipped = loadable_models(repository, install.backends)
        for model, why in skipped.items():
            log.info("not loading model '%s': %s", model, why)
    if not models:
        raise TritonStartError(f"no loadable model in {repository}")
    private_repository(repository, models, work_dir / "repository")
    return install, list(models)

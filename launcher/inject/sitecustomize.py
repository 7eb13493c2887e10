"""Injected by ``ncclwatch torchrun`` into every Python process of the job (via PYTHONPATH).

Python imports ``sitecustomize`` at start-up, so this runs in torchrun and in
each worker before the user's code.  It acts mostly in a torchrun worker
(``NCCLWATCH_RUN_DIR`` and ``RANK`` set, and not a process started by a
worker, see below), and there it:

1. registers torch's global optimizer step post hook, so every
   ``optimizer.step()`` beats (``launcher/heartbeat.py``) with no change to the
   user's code.  torch is not imported here: it takes seconds and the job may
   not use it.  A ``sys.meta_path`` finder waits for ``torch.optim.optimizer``
   to be imported by the job, lets the import run, then registers the hook;
2. names the wrapper an allowed tracer (``PR_SET_PTRACER``), so its py-spy
   can read this process under Yama's ``ptrace_scope=1``;
3. starts a Flight Recorder responder: a daemon thread reading the FIFO
   ``<run_dir>/fr/ncclwatch_pipe.<pid>``.  Any write to it makes this process
   dump its Flight Recorder to ``<run_dir>/fr/ncclwatch_trace_<rank>`` (tmp
   file + ``os.replace``; the rank is the name's trailing digits, as the
   parser reads it): NCCL's recorder (``_dump_nccl_trace``) in a job on
   NCCL, else the one gloo records into (``_dump_fr_trace``); torch keeps
   one per kind of event.  Writes made only of ``-`` ask for no stack
   traces (the performance look's quiet request); anything else for
   everything.  NCCL ranks also have torch's own pipe
   (``TORCH_NCCL_DEBUG_INFO_PIPE_FILE``), which works without the GIL but
   prints a line into the job's stderr at every dump.  A writer should open
   the FIFO with ``O_WRONLY|O_NONBLOCK``: ENXIO then means no responder is
   alive.

A worker's own children inherit ``RANK`` and ``NCCLWATCH_RUN_DIR`` (spawned
DataLoader workers, inductor compile workers): a responder there would
overwrite the rank's dump with an empty one.  So the worker records its pid in
``NCCLWATCH_WORKER_PID`` and a process seeing someone else's pid there does
nothing.

In torchrun itself (``NCCLWATCH_RUN_DIR`` set, no ``RANK``) and in its
workers it keeps each restart round's keys apart in the store the two share.
With torchrun's c10d rendezvous the workers' store is one TCPStore server the
agent keeps for its whole life (``TORCHELASTIC_USE_AGENT_STORE``), and the
env:// rendezvous hands every round a client of it without a per-round prefix
(torch 2.11 and 2.13, pytorch/pytorch#167288).  A restarted round's rank then
finds the dead round's keys: ProcessGroupNCCL's unique id among them, so a
rank that reads it before its rank 0 rewrites it dials the old round's
bootstrap root ("socketPollConnect ... Connection refused" for a minute, then
the round fails).  torchrun records the rendezvous round, which every node
agrees on, in ``NCCLWATCH_RDZV_ROUND`` (workers inherit its environment), and
the workers' env:// store is scoped to ``ncclwatch-round-<round>/``.  The
static rendezvous (``--master-addr``/``--master-port``) keeps its store too;
there the round is torchrun's restart count.

One key no prefix scopes: ProcessGroupNCCL raises its Flight Recorder dump
signal (``exception_dump``) on the store under all prefixes, whatever store
the job built.  With several nodes a rank of the dead round outlives its dead
peer long enough to raise it (its watchdog sees the peer's socket close), and
every rank of the next round acts on it once its process group exists: dump,
then abort (2 wrappers on an H200: the new round's NCCL init refused for a
minute, or a healthy new round killed minutes later).  So torchrun deletes it
as each later round forms: every node's agent has stopped its workers before
it joins, so no rank of the old round is left to raise it again, and none of
the new round has started.  The static rendezvous has no such moment: there
each worker deletes it as it opens the store through env://.

Then it runs the next ``sitecustomize`` on ``sys.path`` (the user's or the
environment's), as Python would have without us.

It must never break the job: our part is inside one broad ``try`` and prints
nothing; the chained module runs outside it, so its own errors reach Python's
``site`` exactly as they would without us.
"""

import os
import sys


def _load_heartbeat():
    """Our ``ncclwatch.launcher.heartbeat`` module, shared with ``ncclwatch.beat`` when possible.

    Import it through the package only if the package Python would import is
    the one this file belongs to (a job may run another ncclwatch install, or
    none); else load the file privately.
    """
    import importlib.util

    ours = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    try:
        spec = importlib.util.find_spec("ncclwatch.launcher.heartbeat")
    except ImportError:
        spec = None
    if spec is not None and spec.origin and os.path.dirname(os.path.realpath(spec.origin)) == ours:
        import ncclwatch.launcher.heartbeat

        return ncclwatch.launcher.heartbeat
    spec = importlib.util.spec_from_file_location("_ncclwatch_heartbeat", os.path.join(ours, "heartbeat.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _register_step_hook(optimizer_module):
    """Called right after ``torch.optim.optimizer`` has run."""
    import itertools

    beat = _load_heartbeat().beat
    steps = itertools.count(1)
    resumed_at = []  # steps the optimizer had taken before this process's first one (a checkpoint's)

    def on_step(optimizer, args, kwargs):
        # This process's count of optimizer steps (with two optimizers, two per iteration), from the step the
        # optimizer's state was restored at: a resumed job beats its training step, so ``--on-hang restart``
        # knows a hang that recurs at the same step.
        counted = next(steps)
        if not resumed_at:
            saved = _saved_step(optimizer)
            resumed_at.append(saved - counted if saved is not None and saved >= counted else 0)
        beat(resumed_at[0] + counted)

    optimizer_module.register_optimizer_step_post_hook(on_step)


def _saved_step(optimizer):
    """Adam-family optimizers' ``state[param]["step"]`` of their first parameter, read once per process: a
    checkpoint loaded with ``map_location="cuda"`` puts it on the GPU, where reading it waits for the GPU."""
    try:
        params = optimizer.param_groups[0]["params"]
        step = optimizer.state[params[0]].get("step") if params and params[0] in optimizer.state else None
        if step is None:
            return None
        return int(step.item()) if hasattr(step, "item") else int(step)
    except Exception:  # an optimizer of another shape: count instead, never fail a training step
        return None


class _RealLoader:
    """Wraps a module's loader to run ``after(module)`` once the module has executed."""

    def __init__(self, loader, after):
        self._loader = loader
        self._after = after

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        # Put the real loader back first: nothing after this import (inspect,
        # importlib.reload, pickle by reference) should ever see the wrapper.
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        try:
            self._after(module)
        except Exception:  # noqa: BLE001, S110 - the job's import must succeed whatever we do
            pass


class _AfterImport:
    """One-shot ``sys.meta_path`` finder for ``name``: the normal finders find it, we wrap the loader.

    On every other import it costs one string comparison; it removes itself
    on first use, so a failed hook is never retried in a loop.
    """

    def __init__(self, name, after):
        self._name = name
        self._after = after

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self._name:
            return None
        try:
            sys.meta_path.remove(self)
        except ValueError:
            return None
        import importlib.util

        # With ourselves removed this is exactly the spec the import would
        # have used; the parent package is already being imported.
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _RealLoader(spec.loader, self._after)
        return spec


def _recorder_dump():
    """The dump function of the recorder this job fills; None before torch.distributed is imported."""
    c10d = sys.modules.get("torch._C._distributed_c10d")
    dist = sys.modules.get("torch.distributed")
    nccl = getattr(c10d, "_dump_nccl_trace", None)
    if nccl is not None and dist is not None and dist.is_initialized() and "nccl" in str(dist.get_backend()):
        return nccl
    return getattr(c10d, "_dump_fr_trace", None)


def _dump_fr(fr_dir, rank, stacks):
    dump = _recorder_dump()
    if dump is None:
        return  # torch (with distributed) not imported yet: no process group to dump
    try:
        data = dump(includeCollectives=True, includeStackTraces=stacks, onlyActive=False)
    except TypeError:  # a torch whose binding takes no options: everything
        data = dump()
    final = os.path.join(fr_dir, f"ncclwatch_trace_{rank}")
    tmp = os.path.join(fr_dir, f".ncclwatch_trace_{rank}.tmp")
    with open(tmp, "wb") as out:
        out.write(data)
    os.replace(tmp, final)


DUMP_AT_EXIT_WAIT_S = 15.0


def _serve_fr(fd, fr_dir, rank, dumping):
    """Dump once per read: bytes that arrive together ask for one snapshot.

    ``dumping`` is held for the length of a dump; at exit the process takes it
    and keeps it, so it never finalises while this thread is inside torch's C++
    (seen: "terminate called without an active exception", exit -6, when a
    short job ended during the sidecar's first, slow dump).
    """
    try:
        while request := os.read(fd, 4096):
            with dumping:
                try:
                    _dump_fr(fr_dir, rank, stacks=bool(request.strip(b"-")))
                except Exception:  # noqa: BLE001, S110 - a failed dump must not end the responder
                    pass
    except Exception:  # noqa: BLE001, S110 - an uncaught error would print a traceback into the job's stderr
        pass


def _start_fr_responder(run_dir, rank):
    import atexit
    import threading

    fr_dir = os.path.join(run_dir, "fr")
    pid = os.getpid()
    fifo = os.path.join(fr_dir, f"ncclwatch_pipe.{pid}")
    try:
        os.unlink(fifo)  # left by an earlier process with this pid
    except FileNotFoundError:
        pass
    os.mkfifo(fifo, 0o600)
    # O_RDWR (Linux) rather than a blocking O_RDONLY open: the FIFO then always
    # has a reader while we live, so a writer's O_NONBLOCK open never fails
    # in the gap between one writer's EOF and our reopening, and read()
    # never returns EOF.  It does not block, so the thread starts at once.
    fd = os.open(fifo, os.O_RDWR)

    def remove():
        # atexit hooks are inherited across fork: only the owner removes it.
        if os.getpid() == pid:
            try:
                os.unlink(fifo)
            except OSError:
                pass

    def close_in_child():
        # A forked child inherits the descriptor but not the thread: close it,
        # or the FIFO would keep a reader after this process died.  Guarded:
        # Python prints any error raised here into the child's stderr.
        try:
            os.close(fd)
        except OSError:
            pass

    dumping = threading.Lock()

    def finish_dump():
        dumping.acquire(timeout=DUMP_AT_EXIT_WAIT_S)  # and keep it: no dump starts while the process ends

    atexit.register(remove)
    atexit.register(finish_dump)
    os.register_at_fork(after_in_child=close_in_child)
    threading.Thread(target=_serve_fr, args=(fd, fr_dir, rank, dumping), name="ncclwatch-fr", daemon=True).start()
    _dump_when_dying(fr_dir, rank, dumping)


DYING_DUMP_WAIT_S = 1.0


def _dump_when_dying(fr_dir, rank, dumping):
    """A rank that dies of an uncaught exception writes its Flight Recorder first (without C++ stack traces: fast).

    torchrun ends the other ranks a tenth of a second after the first one exits, so the dump a failed job's verdict
    needs (where every rank stood, which one issued what) exists only if the rank leaves it as it goes.  torch's
    ``init_process_group`` wraps ``sys.excepthook`` later and calls this one from its own, so both run; a
    ``SystemExit`` (``sys.exit(3)``) is no exception here and leaves nothing.
    """
    previous = sys.excepthook

    def dump_then_report(*exc_info):
        if dumping.acquire(timeout=DYING_DUMP_WAIT_S):
            try:
                _dump_fr(fr_dir, rank, stacks=False)
            except Exception:  # noqa: BLE001, S110 - the rank's own traceback must still be printed
                pass
            finally:
                dumping.release()
        previous(*exc_info)

    sys.excepthook = dump_then_report


def _setup():
    env = os.environ
    run_dir = env.get("NCCLWATCH_RUN_DIR")
    rank = env.get("RANK")
    if run_dir and rank is None:  # torchrun's agent
        sys.meta_path.insert(0, _AfterImport("torch.distributed.elastic.rendezvous.dynamic_rendezvous", _export_round))
        return
    if not run_dir or rank is None or not rank.isdigit():
        return
    owner = env.get("NCCLWATCH_WORKER_PID")
    if owner is not None and owner != str(os.getpid()):
        return
    env["NCCLWATCH_WORKER_PID"] = str(os.getpid())
    _allow_watchdog_ptrace(env.get("NCCLWATCH_WRAPPER_PID"))
    sys.meta_path.insert(0, _AfterImport("torch.optim.optimizer", _register_step_hook))
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and _round(env).isdigit():
        sys.meta_path.insert(0, _AfterImport("torch.distributed.rendezvous", _scope_store_to_round))
    _start_fr_responder(run_dir, int(rank))


_ROUND_ENV = "NCCLWATCH_RDZV_ROUND"
_NCCL_DUMP_SIGNAL = "exception_dump"  # ProcessGroupNCCL's kStoreDumpKey, raised on the store under every prefix


def _export_round(dynamic_rendezvous):
    """In torchrun: after each rendezvous, put its round where the workers it starts next will find it."""
    handler = dynamic_rendezvous.DynamicRendezvousHandler
    join = handler.next_rendezvous

    def next_rendezvous(self, *args, **kwargs):
        info = join(self, *args, **kwargs)
        try:
            round_ = int(self._state_holder.state.round)
        except Exception:  # noqa: BLE001 - another torch's handler: leave the store as torch made it
            os.environ.pop(_ROUND_ENV, None)
            return info
        os.environ[_ROUND_ENV] = str(round_)
        if round_ > 0:
            _clear_dump_signal(self, info)
        return info

    handler.next_rendezvous = next_rendezvous


def _clear_dump_signal(handler, info):
    """Delete the dead round's ``exception_dump`` from the store torchrun keeps for its workers.

    Only where that store outlives the rounds (the agent's shared one): else
    the workers' rank 0 starts a new one, which holds nothing yet and is not
    up for us to reach.
    """
    try:
        if not handler.use_agent_store:
            return
        import datetime

        from torch.distributed import TCPStore

        where = info.bootstrap_store_info
        store = TCPStore(
            where.master_addr,
            where.master_port,
            is_master=False,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=10),
        )
        store.delete_key(_NCCL_DUMP_SIGNAL)
    except Exception:  # noqa: BLE001, S110 - an older torch (no shared store): as torch left it
        pass


def _round(env):
    """The restart round of this worker: the c10d rendezvous's, else (static rendezvous, where no node joins
    late and every node's workers fail into each restart) torchrun's restart count."""
    return env.get(_ROUND_ENV) or env.get("TORCHELASTIC_RESTART_COUNT", "")


def _scope_store_to_round(rendezvous):
    """In a worker: the agent's store, as env:// creates it, seen under this round's prefix."""
    prefix = f"ncclwatch-round-{_round(os.environ)}"
    create = rendezvous._create_c10d_store

    def _create_c10d_store(hostname, port, *args, **kwargs):
        store = create(hostname, port, *args, **kwargs)
        if str(port) != os.environ.get("MASTER_PORT"):
            return store  # a store of the job's own on another port: not the agent's
        try:
            # The agent cleared it as this round formed (c10d rendezvous); the static rendezvous has no moment
            # when every node's old workers are gone, so this is as late as it gets there.
            store.delete_key(_NCCL_DUMP_SIGNAL)
        except Exception:  # noqa: BLE001, S110 - an older store without delete_key: as torch left it
            pass
        from torch.distributed import PrefixStore

        return PrefixStore(prefix, store)

    rendezvous._create_c10d_store = _create_c10d_store


def _allow_watchdog_ptrace(wrapper_pid):
    """Let the wrapper's py-spy read this process under Yama ``ptrace_scope=1`` (Ubuntu's default).

    Yama lets a process trace only its descendants: py-spy is the wrapper's
    child, not an ancestor of this worker.  ``PR_SET_PTRACER`` names the
    wrapper as an allowed tracer, which covers its descendants too.  Without
    Yama the call fails harmlessly (EINVAL); as root it is not needed.
    """
    if not wrapper_pid or not wrapper_pid.isdigit() or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_ptracer = 0x59616D61  # "Yama"
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_ptracer, int(wrapper_pid), 0, 0, 0)


def _next_sitecustomize():
    """The spec of the ``sitecustomize`` Python would have found after this folder, or None."""
    import importlib.machinery

    here = os.path.dirname(os.path.realpath(__file__))
    for index, entry in enumerate(sys.path):
        if os.path.realpath(entry or os.curdir) == here:
            return importlib.machinery.PathFinder.find_spec("sitecustomize", sys.path[index + 1 :])
    return None


try:
    _setup()
except Exception:  # noqa: BLE001, S110 - never break the job; the watchdog just sees less
    pass

try:
    _next = _next_sitecustomize()
except Exception:  # noqa: BLE001 - a broken sys.path entry: run as if there were no next one
    _next = None

if _next is not None and _next.loader is not None:
    import importlib.util

    _module = importlib.util.module_from_spec(_next)
    # The user's module takes the name, as if it had been imported directly;
    # our functions keep their globals alive through their references.
    sys.modules["sitecustomize"] = _module
    _next.loader.exec_module(_module)

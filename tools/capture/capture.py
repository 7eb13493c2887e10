#!/usr/bin/env python3
"""Run train.py under torchrun once per fault scenario and capture real evidence.

For each scenario, in sequence:
  * torchrun --nproc_per_node=<all GPUs> train.py --fault <scenario>, with NCCL
    debug logs, Flight Recorder (FR) and its on-demand FIFO, NVLink multicast off;
  * the heartbeat files are watched; a fault scenario is captured --stall-wait
    seconds after the heartbeats stop advancing, the healthy one ("none") while
    it runs, "exit" after torchrun ends;
  * capture, in this order: FR dump through the FIFOs, NVML (3 snapshots incl.
    GPM), NCCL RAS (text, then json), py-spy dump of every worker,
    /proc/<pid>/status (+ per-thread states), nvidia-smi;
  * the job is killed (SIGCONT the stopped rank, SIGTERM torchrun, SIGKILL the
    leftovers' process groups) and no worker is left behind.

Output layout: see README.md beside this file. Only the standard library is
needed here; pynvml (nvidia-ml-py) and py-spy are used when present and their
absence is recorded, not fatal.
"""

import argparse
import concurrent.futures
import glob
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tarfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(HERE, "train.py")
ALL_SCENARIOS = ("none", "skip", "extra", "python_stuck", "sigstop", "spin_kernel", "exit")
HANG_SCENARIOS = ("skip", "extra", "python_stuck", "sigstop", "spin_kernel")
# Always set, also for dry runs: NVLink multicast must stay off on the shared machines.
SAFETY_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
GPM_METRICS = (("sm_util_pct", 2), ("sm_occupancy_pct", 3), ("dram_bw_util_pct", 10), ("any_tensor_util_pct", 5))
RAS_ADDR = ("127.0.0.1", 28028)
SUBDIRS = ("nccl", "fr", "hb", "torchrun", "ras", "pyspy", "proc")


# ----------------------------------------------------------------- utilities
class Log:
    """Timestamped log to a file (and optionally to stdout / a progress file)."""

    def __init__(self, path, echo=False, progress=None):
        self.f = open(path, "a", buffering=1)
        self.echo = echo
        self.progress = progress

    def __call__(self, msg):
        line = f"{time.time():.3f} {msg}"
        self.f.write(line + "\n")
        if self.echo:
            print(line, flush=True)
        if self.progress is not None:
            self.progress(msg)

    def close(self):
        self.f.close()


def read_text(path, default=None):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return default


def proc_state(pid):
    """'R', 'S', 'T', 't', 'Z', ... or None when the process is gone."""
    st = read_text(f"/proc/{pid}/stat")
    if not st:
        return None
    try:
        return st[st.rindex(")") + 2]
    except (ValueError, IndexError):
        return None


def alive(pid):
    s = proc_state(pid)
    return s is not None and s not in ("Z", "X")


def children_of(ppid):
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        st = read_text(f"/proc/{p}/stat")
        if not st:
            continue
        try:
            fields = st[st.rindex(")") + 2 :].split()
            if int(fields[1]) == ppid:
                out.append(int(p))
        except (ValueError, IndexError):
            continue
    return out


def proc_environ(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    env = {}
    for item in raw.split(b"\0"):
        if b"=" in item:
            k, v = item.split(b"=", 1)
            env[k.decode(errors="replace")] = v.decode(errors="replace")
    return env


def find_workers(torchrun_pid):
    """{rank: {"pid", "rank", "local_rank", "world_size"}} of torchrun's worker children."""
    workers = {}
    for pid in children_of(torchrun_pid):
        env = proc_environ(pid)
        if "RANK" in env:
            r = int(env["RANK"])
            workers[r] = {
                "rank": r,
                "local_rank": int(env.get("LOCAL_RANK", r)),
                "world_size": int(env.get("WORLD_SIZE", 0)),
                "pid": pid,
                "group_rank": int(env.get("GROUP_RANK", 0)),
            }
    return workers


def read_heartbeats(hb_dir):
    """{rank: (step, unix_time)}"""
    hbs = {}
    for path in glob.glob(os.path.join(hb_dir, "hb.*")):
        try:
            rank = int(path.rsplit(".", 1)[1])
            step, t = read_text(path, "").split()[:2]
            hbs[rank] = (int(step), float(t))
        except (ValueError, IndexError):
            continue
    return hbs


def run_cmd(cmd, timeout=15):
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return r.returncode, r.stdout, r.stderr
    except FileNotFoundError as e:
        return 127, "", str(e)
    except subprocess.TimeoutExpired as e:
        return (
            124,
            (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or ""),
            f"timeout after {timeout}s",
        )


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")


def gpu_count():
    rc, out, _ = run_cmd(["nvidia-smi", "-L"], timeout=20)
    if rc != 0:
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def gpu_compute_pids():
    rc, out, _ = run_cmd(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], timeout=20)
    if rc != 0:
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


# ------------------------------------------------------------ evidence steps
def fr_trigger(d, workers, log, wait_s):
    """Write one byte to each rank's FR FIFO, then wait for the dumps."""
    fr_dir = os.path.join(d, "fr")
    expected = []
    t0 = time.time()
    for r, w in sorted(workers.items()):
        pipe = os.path.join(fr_dir, f"pipe_{r}.pipe")
        st = proc_state(w["pid"])
        try:
            fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
            try:
                os.write(fd, b"1")
            finally:
                os.close(fd)
            log(f"fr: rank {r} pid {w['pid']} state {st}: byte written to {os.path.basename(pipe)}")
            if st not in ("T", "t", None, "Z"):
                expected.append(r)
        except OSError as e:
            log(f"fr: rank {r} pid {w['pid']} state {st}: cannot write {os.path.basename(pipe)}: {e}")
    # wait until every expected dump exists with a stable size, at most wait_s
    deadline = t0 + wait_s
    last_sizes = None
    while time.time() < deadline:
        sizes = {}
        for r in expected:
            p = os.path.join(fr_dir, f"nccl_trace_rank_{r}")
            try:
                sizes[r] = os.path.getsize(p)
            except OSError:
                pass
        if len(sizes) == len(expected) and sizes == last_sizes and all(v > 0 for v in sizes.values()):
            break
        last_sizes = sizes
        time.sleep(0.25)
    got = sorted(
        int(p.rsplit("_", 1)[1])
        for p in glob.glob(os.path.join(fr_dir, "nccl_trace_rank_*"))
        if p.rsplit("_", 1)[1].isdigit()
    )
    log(f"fr: dumps present for ranks {got} after {time.time() - t0:.2f}s (expected {expected})")
    return got


def nvml_snapshots(n, interval, log):
    """List of snapshots in OUR format (see README.md)."""
    try:
        import pynvml
    except ImportError as e:
        log(f"nvml: pynvml not importable: {e}")
        return None, f"pynvml not importable: {e}"
    try:
        pynvml.nvmlInit()
    except Exception as e:  # noqa: BLE001
        log(f"nvml: init failed: {e}")
        return None, f"nvmlInit failed: {e}"

    def safe(fn, *a):
        try:
            return fn(*a)
        except Exception:  # noqa: BLE001
            return None

    snaps = []
    samples = {}
    try:
        count = pynvml.nvmlDeviceGetCount()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        gpm_ok = []
        for h in handles:
            try:
                gpm_ok.append(bool(pynvml.nvmlGpmQueryDeviceSupport(h).isSupportedDevice))
            except Exception as e:  # noqa: BLE001
                log(f"nvml: GPM support query failed: {e}")
                gpm_ok.append(False)

        def take_samples():
            out = {}
            for i, h in enumerate(handles):
                if not gpm_ok[i]:
                    continue
                try:
                    s = pynvml.nvmlGpmSampleAlloc()
                    pynvml.nvmlGpmSampleGet(h, s)
                    out[i] = s
                except Exception as e:  # noqa: BLE001
                    log(f"nvml: GPM sample gpu {i} failed: {e}")
            return out

        samples = take_samples()
        for _ in range(n):
            time.sleep(interval)
            cur = take_samples()
            snap = {"time": time.time(), "gpus": []}
            for i, h in enumerate(handles):
                g = {"index": i}
                uuid = safe(pynvml.nvmlDeviceGetUUID, h)
                g["uuid"] = uuid.decode() if isinstance(uuid, bytes) else uuid
                pci = safe(pynvml.nvmlDeviceGetPciInfo, h)
                bus = getattr(pci, "busId", None) if pci is not None else None
                g["bus_id"] = bus.decode() if isinstance(bus, bytes) else bus
                util = safe(pynvml.nvmlDeviceGetUtilizationRates, h)
                g["util_gpu_pct"] = util.gpu if util is not None else None
                g["util_mem_pct"] = util.memory if util is not None else None
                pw = safe(pynvml.nvmlDeviceGetPowerUsage, h)
                g["power_w"] = round(pw / 1000.0, 3) if pw is not None else None
                g["sm_clock_mhz"] = safe(pynvml.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_SM)
                gpm = None
                if i in samples and i in cur:
                    try:
                        mg = pynvml.c_nvmlGpmMetricsGet_t()
                        mg.version = pynvml.NVML_GPM_METRICS_GET_VERSION
                        mg.numMetrics = len(GPM_METRICS)
                        mg.sample1 = samples[i]
                        mg.sample2 = cur[i]
                        for k, (_, mid) in enumerate(GPM_METRICS):
                            mg.metrics[k].metricId = mid
                        pynvml.nvmlGpmMetricsGet(mg)
                        gpm = {}
                        for k, (name, _) in enumerate(GPM_METRICS):
                            m = mg.metrics[k]
                            gpm[name] = round(m.value, 4) if int(m.nvmlReturn) == 0 else None
                    except Exception as e:  # noqa: BLE001
                        log(f"nvml: GPM metrics gpu {i} failed: {e}")
                        gpm = None
                g["gpm"] = gpm
                procs = safe(pynvml.nvmlDeviceGetComputeRunningProcesses, h) or []
                g["processes"] = [{"pid": int(p.pid), "used_memory_bytes": p.usedGpuMemory} for p in procs]
                snap["gpus"].append(g)
            snaps.append(snap)
            for s in samples.values():
                safe(pynvml.nvmlGpmSampleFree, s)
            samples = cur
        return snaps, None
    except Exception as e:  # noqa: BLE001
        log(f"nvml: failed: {e}")
        return snaps or None, f"nvml failed: {e}"
    finally:
        for s in samples.values():
            safe(pynvml.nvmlGpmSampleFree, s)
        safe(pynvml.nvmlShutdown)


def ras_query(json_format, log, server_timeout=5, total_timeout=8.0):
    """Talk to NCCL RAS; return (report_bytes, transcript_lines, error_or_None)."""
    transcript = []
    buf = b""
    t0 = time.time()
    deadline = t0 + total_timeout

    def remaining():
        return max(0.1, deadline - time.time())

    def send(s, text):
        transcript.append(f"{time.time() - t0:7.3f} > {text.rstrip()}")
        s.sendall(text.encode())

    def readline(s):
        nonlocal buf
        while b"\n" not in buf:
            s.settimeout(remaining())
            chunk = s.recv(4096)
            if not chunk:
                raise ConnectionError("server closed the connection during the handshake")
            buf += chunk
        line, buf = buf.split(b"\n", 1)
        text = line.decode(errors="replace")
        transcript.append(f"{time.time() - t0:7.3f} < {text}")
        return text

    s = None
    try:
        s = socket.create_connection(RAS_ADDR, timeout=3.0)
        send(s, "CLIENT PROTOCOL 2\n")
        ans = readline(s)
        if not ans.startswith("SERVER PROTOCOL"):
            transcript.append(f"unexpected protocol answer: {ans!r}")
        send(s, f"TIMEOUT {server_timeout}\n")
        ans = readline(s)
        if ans.strip() != "OK":
            transcript.append(f"unexpected TIMEOUT answer: {ans!r}")
        if json_format:
            send(s, "SET FORMAT json\n")
            ans = readline(s)
            if ans.strip() != "OK":
                transcript.append(f"unexpected SET FORMAT answer: {ans!r}")
        send(s, "VERBOSE STATUS\n")
        while True:
            s.settimeout(remaining())
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
        transcript.append(f"{time.time() - t0:7.3f} < [{len(buf)} bytes, server closed]")
        return buf, transcript, None
    except Exception as e:  # noqa: BLE001
        transcript.append(f"{time.time() - t0:7.3f} ERROR {type(e).__name__}: {e}")
        if buf:
            transcript.append(f"{time.time() - t0:7.3f} < [{len(buf)} bytes before the error, saved]")
        return (buf if buf else None), transcript, f"{type(e).__name__}: {e}"
    finally:
        if s is not None:
            try:
                s.close()
            except OSError:
                pass


def capture_ras(d, log):
    res = {}
    for name, js in (("ras.txt", False), ("ras.json", True)):
        if js and res.get("ras.txt", {}).get("no_answer"):
            # the server accepted but never answered the handshake: do not spend more timeouts on it
            report, transcript, err = (
                None,
                ["skipped: the text query got no handshake answer"],
                "skipped: the text query got no handshake answer",
            )
        else:
            report, transcript, err = ras_query(js, log)
            if err and not any(" < " in t for t in transcript) and "refused" not in err:
                # Every NCCL process listens on 28028; a connection may have landed on a stopped
                # one. A new connection may reach another process: try once more.
                transcript.append("retry with a new connection")
                report, t2, err = ras_query(js, log)
                transcript += t2
        base = os.path.join(d, "ras", name)
        if report is not None:
            with open(base, "wb") as f:
                f.write(report)
        if err:
            with open(base + ".error", "w") as f:
                f.write(err + "\n")
        with open(os.path.join(d, "ras", "transcript.log"), "a") as f:
            f.write(f"# {name}\n" + "\n".join(transcript) + "\n")
        valid = None
        if js and report:
            try:
                json.loads(report.decode(errors="replace"))
                valid = True
            except ValueError:
                valid = False
        res[name] = {
            "bytes": len(report) if report is not None else None,
            "error": err,
            "json_valid": valid,
            "no_answer": bool(err) and not any(" < " in t for t in transcript),
        }
        log(f"ras: {name}: {res[name]}")
    return res


def find_pyspy(explicit):
    for c in (explicit, shutil.which("py-spy"), "/tmp/site/bin/py-spy"):
        if c and os.path.exists(c):
            return c
    return None


def capture_pyspy(d, workers, pyspy, log, timeout_s):
    if not pyspy:
        log("pyspy: py-spy not found, skipped")
        with open(os.path.join(d, "pyspy", "pyspy.error.txt"), "w") as f:
            f.write("py-spy not found\n")
        return {}
    before = {r: proc_state(w["pid"]) for r, w in workers.items()}

    def one(r):
        pid = workers[r]["pid"]
        st = before[r]
        if st is None or st in ("Z", "X"):
            return r, "gone"
        cmd = [pyspy, "dump", "--pid", str(pid), "--json"]
        mode = "blocking"
        if st in ("T", "t"):
            # a stopped process: never ptrace-stop it; read its memory without stopping
            cmd.append("--nonblocking")
            mode = "nonblocking"
        t0 = time.time()
        try:
            r_ = subprocess.run(cmd, capture_output=True, timeout=timeout_s)
            rc, out, err = r_.returncode, r_.stdout, r_.stderr
        except subprocess.TimeoutExpired as e:
            rc, out, err = 124, e.stdout or b"", (e.stderr or b"") + f"\ntimeout after {timeout_s}s".encode()
        dt = time.time() - t0
        if rc == 0 and out.strip():
            with open(os.path.join(d, "pyspy", f"pyspy.{pid}.json"), "wb") as f:
                f.write(out)
            return r, f"ok {mode} {dt:.2f}s"
        with open(os.path.join(d, "pyspy", f"pyspy.{pid}.error.txt"), "wb") as f:
            f.write(f"cmd: {' '.join(cmd)}\nrc: {rc}\nstate before: {st}\nseconds: {dt:.2f}\n".encode())
            f.write(b"stderr:\n" + (err or b"") + b"\nstdout:\n" + (out or b""))
        return r, f"failed rc={rc} {mode} {dt:.2f}s"

    results = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(workers))) as ex:
        for r, res in ex.map(one, sorted(workers)):
            results[r] = res
    # never leave a process stopped because of py-spy
    time.sleep(0.2)
    for r, w in workers.items():
        st = proc_state(w["pid"])
        if st in ("T", "t") and before[r] not in ("T", "t"):
            log(f"pyspy: rank {r} pid {w['pid']} left in state {st} after py-spy: SIGCONT")
            try:
                os.kill(w["pid"], signal.SIGCONT)
            except OSError as e:
                log(f"pyspy: SIGCONT {w['pid']} failed: {e}")
    log(f"pyspy: {results}")
    return results


def capture_proc(d, workers, log):
    for r, w in sorted(workers.items()):
        pid = w["pid"]
        st = read_text(f"/proc/{pid}/status")
        if st is None:
            log(f"proc: rank {r} pid {pid} gone")
            continue
        with open(os.path.join(d, "proc", f"status.{pid}"), "w") as f:
            f.write(st)
        lines = []
        for tdir in sorted(glob.glob(f"/proc/{pid}/task/*"), key=lambda p: int(p.rsplit("/", 1)[1])):
            tid = tdir.rsplit("/", 1)[1]
            tstat = read_text(f"{tdir}/stat", "")
            comm = (read_text(f"{tdir}/comm", "") or "").strip()
            wchan = (read_text(f"{tdir}/wchan", "") or "").strip()
            try:
                tst = tstat[tstat.rindex(")") + 2]
            except (ValueError, IndexError):
                tst = "?"
            lines.append(f"{tid}\t{tst}\t{wchan or '-'}\t{comm}")
        with open(os.path.join(d, "proc", f"threads.{pid}.txt"), "w") as f:
            f.write("# tid\tstate\twchan\tcomm\n" + "\n".join(lines) + "\n")


def capture_smi(d, log):
    rc, out, err = run_cmd(
        [
            "nvidia-smi",
            "--query-gpu=index,utilization.gpu,utilization.memory,power.draw,clocks.sm,memory.used",
            "--format=csv,noheader",
        ],
        timeout=20,
    )
    if rc == 0:
        with open(os.path.join(d, "smi.csv"), "w") as f:
            f.write(out)
    else:
        with open(os.path.join(d, "smi.csv.error"), "w") as f:
            f.write(f"rc={rc}\n{err}\n")
    log(f"smi: rc={rc}")


def capture_all(d, workers, cfg, log, times):
    times["capture_start_unix"] = time.time()
    states = {r: proc_state(w["pid"]) for r, w in sorted(workers.items())}
    log(f"capture: start; worker states {states}")
    fr_trigger(d, workers, log, cfg.fr_wait)
    times["capture_fr_done_unix"] = time.time()
    snaps, err = nvml_snapshots(cfg.nvml_snapshots, 1.0, log)
    if snaps is not None:
        write_json(os.path.join(d, "nvml.json"), snaps)
    if err:
        with open(os.path.join(d, "nvml.json.error"), "w") as f:
            f.write(err + "\n")
    times["capture_nvml_done_unix"] = time.time()
    ras = capture_ras(d, log)
    times["capture_ras_done_unix"] = time.time()
    pys = capture_pyspy(d, workers, cfg.pyspy, log, cfg.pyspy_timeout)
    times["capture_pyspy_done_unix"] = time.time()
    capture_proc(d, workers, log)
    capture_smi(d, log)
    times["capture_end_unix"] = time.time()
    log(f"capture: done in {times['capture_end_unix'] - times['capture_start_unix']:.1f}s")
    return {"ras": ras, "pyspy": pys, "worker_states_at_capture": states}


# ------------------------------------------------------------ job management
def kill_job(tr, workers, log, times):
    times["kill_unix"] = time.time()
    for r, w in sorted(workers.items()):
        if proc_state(w["pid"]) in ("T", "t"):
            # SIGTERM first, so that it is pending: the rank dies as soon as SIGCONT resumes it,
            # instead of running on (finishing its step, writing logs) before torchrun's SIGTERM.
            log(f"kill: rank {r} pid {w['pid']} is stopped: SIGTERM then SIGCONT")
            for sig in (signal.SIGTERM, signal.SIGCONT):
                try:
                    os.kill(w["pid"], sig)
                except OSError:
                    pass
    if tr.poll() is None:
        log(f"kill: SIGTERM torchrun {tr.pid}")
        try:
            os.kill(tr.pid, signal.SIGTERM)
        except OSError:
            pass
        try:
            tr.wait(timeout=8)
        except subprocess.TimeoutExpired:
            log("kill: torchrun still alive after 8s")
    leftovers = [w["pid"] for w in workers.values() if alive(w["pid"])]
    if tr.poll() is None or leftovers:
        log(f"kill: SIGKILL torchrun pgid {tr.pid} and worker pgids {leftovers}")
        for pg in [tr.pid] + leftovers:
            try:
                os.killpg(pg, signal.SIGKILL)
            except OSError:
                pass
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            tr.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log("kill: torchrun did not die after SIGKILL")
    for _ in range(50):
        left = [w["pid"] for w in workers.values() if alive(w["pid"])]
        if not left:
            break
        time.sleep(0.2)
    left = [w["pid"] for w in workers.values() if alive(w["pid"])]
    log(f"kill: done; torchrun rc={tr.poll()} workers still alive: {left}")
    return left


def wait_gpus_free(log, timeout_s=20.0):
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        pids = gpu_compute_pids()
        if not pids:
            log(f"gpus free after {time.time() - t0:.1f}s")
            return True
        time.sleep(0.5)
    log(f"gpus still have compute processes after {timeout_s}s: {gpu_compute_pids()}")
    return False


def flatten_torchrun_logs(d, log):
    """torchrun/logs/<run>/attempt_N/<local_rank>/{stdout,stderr}.log -> torchrun/rank<r>.<stream>.log"""
    base = os.path.join(d, "torchrun", "logs")
    for path in glob.glob(os.path.join(base, "*", "attempt_*", "*", "*.log")):
        parts = path.split(os.sep)
        lr, stream = parts[-2], parts[-1][:-4]
        dst = os.path.join(d, "torchrun", f"rank{lr}.{stream}.log")
        try:
            shutil.copyfile(path, dst)
        except OSError as e:
            log(f"logs: cannot copy {path}: {e}")
    shutil.rmtree(base, ignore_errors=True)


FROZEN = ("nccl", "hb", "fr")


def remove_fifos(d):
    for p in glob.glob(os.path.join(d, "fr", "*")):
        try:
            if stat.S_ISFIFO(os.lstat(p).st_mode):
                os.unlink(p)
        except OSError:
            pass


def freeze(d):
    """Contents of the files the job keeps writing (nccl/, hb/, fr/), as of the end of a capture."""
    snap = {}
    for sub in FROZEN:
        for p in glob.glob(os.path.join(d, sub, "*")):
            try:
                if stat.S_ISREG(os.lstat(p).st_mode):
                    with open(p, "rb") as f:
                        snap[os.path.relpath(p, d)] = f.read()
            except OSError:
                pass
    return snap


def restore(d, snap, log):
    """Put back the capture-time contents; what the job wrote while being killed goes to after_kill/."""
    now = freeze(d)
    for rel, data in sorted(now.items()):
        if snap.get(rel) == data:
            continue
        dst = os.path.join(d, "after_kill", rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with open(dst, "wb") as f:
            f.write(data)
        if rel in snap:
            with open(os.path.join(d, rel), "wb") as f:
                f.write(snap[rel])
            log(f"freeze: {rel} changed after the capture; restored, later version in after_kill/{rel}")
        else:
            os.unlink(os.path.join(d, rel))
            log(f"freeze: {rel} appeared after the capture; moved to after_kill/{rel}")
    for rel in sorted(set(snap) - set(now)):
        with open(os.path.join(d, rel), "wb") as f:
            f.write(snap[rel])
        log(f"freeze: {rel} vanished after the capture; restored")


# ------------------------------------------------------------------ scenario
def run_scenario(name, cfg, port, deadline, progress):
    d = os.path.join(cfg.work, name)
    shutil.rmtree(d, ignore_errors=True)
    for sub in SUBDIRS:
        os.makedirs(os.path.join(d, sub), exist_ok=True)
    log = Log(os.path.join(d, "capture.log"), echo=True)
    times = {"start_unix": time.time()}
    fault_rank = cfg.fault_rank if cfg.fault_rank >= 0 else cfg.nproc - 1
    healthy = name == "none"
    steps = cfg.healthy_steps if healthy else cfg.steps
    step_sleep = cfg.healthy_step_sleep if healthy else cfg.step_sleep

    env = dict(os.environ)
    env.update(SAFETY_ENV)
    env.update(
        {
            "NCCL_DEBUG": "INFO",
            "NCCL_DEBUG_SUBSYS": "INIT,COLL",
            "NCCL_DEBUG_FILE": os.path.join(d, "nccl", "nccl.%h.%p.log"),
            "TORCH_FR_BUFFER_SIZE": "2000",
            "TORCH_FR_DUMP_TEMP_FILE": os.path.join(d, "fr", "nccl_trace_rank_"),
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": os.path.join(d, "fr", "pipe_"),
            "TORCH_NCCL_ENABLE_TIMING": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    set_env = {
        k: env[k]
        for k in sorted(
            set(SAFETY_ENV)
            | {
                "NCCL_DEBUG",
                "NCCL_DEBUG_SUBSYS",
                "NCCL_DEBUG_FILE",
                "TORCH_FR_BUFFER_SIZE",
                "TORCH_FR_DUMP_TEMP_FILE",
                "TORCH_NCCL_DUMP_ON_TIMEOUT",
                "TORCH_NCCL_DEBUG_INFO_PIPE_FILE",
                "TORCH_NCCL_ENABLE_TIMING",
            }
        )
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={cfg.nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
        f"--log-dir={os.path.join(d, 'torchrun', 'logs')}",
        "--tee=3",
        TRAIN,
        "--dir",
        d,
        "--steps",
        str(steps),
        "--fault",
        name,
        "--fault-rank",
        str(fault_rank),
        "--fault-step",
        str(cfg.fault_step),
        "--backend",
        cfg.backend,
        "--pg-timeout",
        str(cfg.pg_timeout),
        "--step-sleep",
        str(step_sleep),
    ]
    if cfg.ar_mib is not None:
        cmd += ["--ar-mib", str(cfg.ar_mib)]
    log(f"scenario {name}: {' '.join(cmd)}")
    console = open(os.path.join(d, "torchrun", "console.log"), "wb")
    tr = subprocess.Popen(cmd, stdout=console, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=cfg.work)
    times["torchrun_pid"] = tr.pid
    workers = {}
    mode = None
    cap = {}
    frozen = None
    last_sig = None
    last_change = time.time()
    captured = False
    hard_deadline = min(deadline, time.time() + cfg.scenario_timeout)
    try:
        while True:
            now = time.time()
            if len(workers) < cfg.nproc and tr.poll() is None:
                ws = find_workers(tr.pid)
                for r, w in ws.items():
                    workers.setdefault(r, w)
                if len(workers) == cfg.nproc and "workers_up_unix" not in times:
                    times["workers_up_unix"] = now
                    write_json(
                        os.path.join(d, "ranks.json"),
                        {"torchrun_pid": tr.pid, "workers": [workers[r] for r in sorted(workers)]},
                    )
                    rank_pids = {r: w["pid"] for r, w in sorted(workers.items())}
                    log(f"workers: rank -> pid {rank_pids}")
            hbs = read_heartbeats(os.path.join(d, "hb"))
            sig = tuple(sorted(hbs.items()))
            if sig != last_sig:
                last_sig = sig
                last_change = now
                if hbs and "first_hb_unix" not in times:
                    times["first_hb_unix"] = now
            if tr.poll() is not None:
                times["torchrun_exit_unix"] = now
                log(f"torchrun exited rc={tr.returncode}; heartbeats {dict(hbs)}")
                break
            if (
                healthy
                and not captured
                and hbs
                and len(hbs) == cfg.nproc
                and min(s for s, _ in hbs.values()) >= cfg.healthy_capture_step
            ):
                mode = "live"
                log("healthy: live capture while the job runs")
                cap = capture_all(d, workers, cfg, log, times)
                captured = True
                continue
            if not healthy and hbs and now - last_change >= cfg.stall_wait:
                times["stall_detected_unix"] = now
                mode = "hang"
                log(f"stall: heartbeats unchanged for {now - last_change:.1f}s: {dict(hbs)}")
                break
            if not hbs and "workers_up_unix" in times and now - times["workers_up_unix"] > cfg.first_hb_timeout:
                mode = "no_heartbeat"
                log(f"no heartbeat {cfg.first_hb_timeout}s after the workers started")
                break
            if now >= hard_deadline:
                mode = "deadline"
                log("scenario deadline reached")
                break
            time.sleep(0.2)

        if tr.poll() is None:
            # hung (or out of time): capture now, while every process is as the fault left it
            cap = capture_all(d, workers, cfg, log, times)
            remove_fifos(d)
            frozen = freeze(d)
        elif mode is None:
            mode = "post_exit" if not healthy else ("live" if captured else "post_exit")
            if not captured:
                cap = capture_all(d, workers, cfg, log, times)
    finally:
        left = kill_job(tr, workers, log, times)
        console.close()
        times["end_unix"] = time.time()
        wait_gpus_free(log)
        flatten_torchrun_logs(d, log)
        remove_fifos(d)
        if frozen is not None:
            restore(d, frozen, log)

    # metadata
    hbs = read_heartbeats(os.path.join(d, "hb"))
    if hbs:
        times["last_progress_unix"] = max(t for _, t in hbs.values())
    for p in glob.glob(os.path.join(d, "fault.*")):
        try:
            times["fault_unix"] = float(read_text(p).split()[2])
        except (ValueError, IndexError, AttributeError):
            pass
    metas = {}
    for p in glob.glob(os.path.join(d, "meta.*.json")):
        try:
            m = json.loads(read_text(p))
            metas[m["rank"]] = m
        except (ValueError, KeyError, TypeError):
            pass
    m0 = metas.get(0, {})
    scen = {
        "scenario": name,
        "fault": name,
        "fault_rank": None if healthy else fault_rank,
        "fault_step": None if healthy else cfg.fault_step,
        "nranks": cfg.nproc,
        "steps": steps,
        "step_sleep_s": step_sleep,
        "torch": m0.get("torch"),
        "nccl": m0.get("nccl"),
        "cuda": m0.get("cuda"),
        "device_name": m0.get("device_name"),
        "host": m0.get("host", socket.gethostname()),
        "backend": cfg.backend,
        "pg_timeout_s": cfg.pg_timeout,
        "stall_wait_s": cfg.stall_wait,
        "capture_mode": mode,
        "torchrun_rc": tr.returncode,
        "workers_left_alive": left,
        "heartbeats": {str(r): {"step": s, "time": t} for r, (s, t) in sorted(hbs.items())},
        "ras": cap.get("ras"),
        "pyspy": {str(k): v for k, v in (cap.get("pyspy") or {}).items()},
        "worker_states_at_capture": {str(k): v for k, v in (cap.get("worker_states_at_capture") or {}).items()},
        "env": set_env,
        "command": cmd,
    }
    write_json(os.path.join(d, "scenario.json"), scen)
    order = (
        "start_unix",
        "workers_up_unix",
        "first_hb_unix",
        "fault_unix",
        "last_progress_unix",
        "stall_detected_unix",
        "capture_start_unix",
        "capture_fr_done_unix",
        "capture_nvml_done_unix",
        "capture_ras_done_unix",
        "capture_pyspy_done_unix",
        "capture_end_unix",
        "torchrun_exit_unix",
        "kill_unix",
        "end_unix",
    )
    with open(os.path.join(d, "times.txt"), "w") as f:
        for k in order:
            if k in times:
                f.write(f"{k}={times[k]:.3f}\n")
    dur = times["end_unix"] - times["start_unix"]
    progress(
        f"scenario {name}: mode={mode} rc={tr.returncode} hb={ {r: s for r, (s, _) in sorted(hbs.items())} } "
        f"ras={ {k: (v['bytes'], v['json_valid']) for k, v in (cap.get('ras') or {}).items()} } "
        f"pyspy={cap.get('pyspy')} left={left} took {dur:.1f}s"
    )
    log.close()
    return dur


def machine_info(path, cfg):
    parts = []
    rc, out, err = run_cmd(
        [
            sys.executable,
            "-c",
            "import torch,sys;print('torch', torch.__version__, 'nccl', "
            "torch.cuda.nccl.version() if torch.cuda.is_available() else None, "
            "'ngpu', torch.cuda.device_count(), 'py', sys.version.split()[0])",
        ],
        timeout=60,
    )
    parts.append(out + err)
    for c in (["nvidia-smi"], ["nvidia-smi", "topo", "-m"], [cfg.pyspy or "py-spy", "--version"], ["uname", "-a"]):
        rc, out, err = run_cmd(c, timeout=20)
        parts.append(f"$ {' '.join(c)}  (rc={rc})\n{out}{err}")
    try:
        from importlib.metadata import version

        import pynvml  # noqa: F401

        parts.append(f"nvidia-ml-py {version('nvidia-ml-py')}")
    except Exception as e:  # noqa: BLE001
        parts.append(f"pynvml: {e}")
    with open(path, "w") as f:
        f.write("\n".join(parts) + "\n")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="/tmp/ncclwatch-capture", help="work directory, one folder per scenario")
    p.add_argument("--scenarios", default="all", help="comma list or 'all': " + ",".join(ALL_SCENARIOS))
    p.add_argument("--nproc", type=int, default=0, help="ranks (default: number of GPUs)")
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--step-sleep", type=float, default=0.2)
    p.add_argument("--healthy-steps", type=int, default=40)
    p.add_argument("--healthy-step-sleep", type=float, default=0.5)
    p.add_argument(
        "--healthy-capture-step",
        type=int,
        default=5,
        help="the healthy run is captured live once every rank has passed this step",
    )
    p.add_argument("--fault-step", type=int, default=15)
    p.add_argument("--fault-rank", type=int, default=-1, help="default: last rank")
    p.add_argument("--pg-timeout", type=float, default=300.0)
    p.add_argument("--ar-mib", type=float, default=None, help="override train.py's 64 MiB all_reduce")
    p.add_argument(
        "--stall-wait", type=float, default=15.0, help="capture this long after the heartbeats stopped advancing"
    )
    p.add_argument("--first-hb-timeout", type=float, default=120.0)
    p.add_argument("--scenario-timeout", type=float, default=150.0)
    p.add_argument("--fr-wait", type=float, default=3.0)
    p.add_argument("--nvml-snapshots", type=int, default=3)
    p.add_argument("--pyspy", default=None, help="py-spy binary (default: PATH, then /tmp/site/bin/py-spy)")
    p.add_argument("--pyspy-timeout", type=float, default=10.0)
    p.add_argument("--budget", type=float, default=0, help="total seconds for all scenarios (0: no limit)")
    p.add_argument(
        "--min-left",
        type=float,
        default=55.0,
        help="do not start a scenario with less than this many seconds of budget left",
    )
    p.add_argument("--port", type=int, default=29600)
    p.add_argument("--tar", default=None, help="pack the work directory into this .tar.gz at the end")
    p.add_argument("--tar-name", default="captures", help="top folder name inside the tarball")
    p.add_argument("--progress", default=None, help="append progress lines to this file")
    return p.parse_args(argv)


def main(argv=None):
    cfg = parse_args(argv)
    t_start = time.time()
    deadline = t_start + cfg.budget if cfg.budget > 0 else float("inf")
    os.makedirs(cfg.work, exist_ok=True)
    cfg.work = os.path.abspath(cfg.work)
    cfg.pyspy = find_pyspy(cfg.pyspy)
    if cfg.nproc <= 0:
        cfg.nproc = gpu_count()
        if cfg.nproc <= 0:
            sys.exit("no GPU found: use --nproc N --backend gloo for a CPU dry run")
    for k, v in SAFETY_ENV.items():
        os.environ[k] = v
    scenarios = ALL_SCENARIOS if cfg.scenarios == "all" else tuple(s for s in cfg.scenarios.split(",") if s)
    for s in scenarios:
        if s not in ALL_SCENARIOS:
            sys.exit(f"unknown scenario {s}")

    def progress(msg):
        line = f"{time.time():.3f} +{time.time() - t_start:6.1f}s {msg}"
        print(line, flush=True)
        if cfg.progress:
            with open(cfg.progress, "a") as f:
                f.write(line + "\n")

    progress(f"start: nproc={cfg.nproc} backend={cfg.backend} scenarios={scenarios} py-spy={cfg.pyspy}")
    try:
        machine_info(os.path.join(cfg.work, "machine.txt"), cfg)
        progress("machine.txt written")
        for i, s in enumerate(scenarios):
            left = deadline - time.time()
            if left < cfg.min_left:
                progress(f"scenario {s}: SKIPPED, only {left:.0f}s of budget left")
                continue
            try:
                run_scenario(s, cfg, cfg.port + i, deadline, progress)
            except Exception as e:  # noqa: BLE001
                import traceback

                progress(f"scenario {s}: driver error {type(e).__name__}: {e}\n{traceback.format_exc()}")
    finally:
        if cfg.progress and os.path.exists(cfg.progress):
            shutil.copyfile(cfg.progress, os.path.join(cfg.work, "progress.log"))
        if cfg.tar:
            with tarfile.open(cfg.tar, "w:gz") as tf:
                tf.add(cfg.work, arcname=cfg.tar_name)
            progress(f"packed {cfg.tar}: {os.path.getsize(cfg.tar)} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())

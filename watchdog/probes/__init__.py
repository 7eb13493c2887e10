"""Quick readers of live facts, shared by the sidecar's decision loop and evidence capture.

| module | reads | cost |
| --- | --- | --- |
| ``procfs`` | /proc/<pid>/{stat,status,io,wchan,environ,task/*} | microseconds, sync |
| ``pyspy`` | py-spy dump --json of one process (async subprocess, bounded) | ~0.1 s |
| ``nvml`` | one NVML snapshot in ncclwatch's JSON format, GPM over a window | window + ms, sync or in a thread |
| ``ras`` | NCCL RAS status report over 127.0.0.1:28028 (async) | ms, up to the server's TIMEOUT |
| ``infiniband`` | /sys/class/infiniband port states and counters, deltas | ms, sync |

Each reader turns "not here" (no GPU, no NCCL, no py-spy, a vanished
process, no permission) into None or an error string, never an exception.
"""

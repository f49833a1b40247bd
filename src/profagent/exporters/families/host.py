"""Host source families: per (rank, role) process usage, plus a minimal node view."""

from __future__ import annotations

from profagent.contracts import HostSnapshot
from profagent.exporters.families import Families

GROUP = ("job_id", "rank", "role")


def render(snap: HostSnapshot, out: Families) -> None:
    cpu = out.counter(
        "profagent_process_cpu_seconds", "CPU time of the group's processes by mode", (*GROUP, "mode")
    )
    rss = out.gauge("profagent_process_resident_memory_bytes", "resident memory of the group's processes", GROUP)
    uss = out.gauge(
        "profagent_process_unique_memory_bytes",
        "memory unique to the group's processes (USS: shared pages not counted); DataLoader workers only", GROUP,
    )
    threads = out.gauge("profagent_process_threads", "threads of the group's processes", GROUP)
    fds = out.gauge("profagent_process_open_fds", "open file descriptors of the group's processes", GROUP)
    procs = out.gauge("profagent_processes", "live processes in the group (DataLoader workers...)", GROUP)
    read = out.counter("profagent_process_io_read_bytes", "bytes read from storage by the group", GROUP)
    write = out.counter("profagent_process_io_written_bytes", "bytes written to storage by the group", GROUP)
    ctx = out.counter(
        "profagent_process_context_switches", "context switches of the group by kind", (*GROUP, "kind")
    )
    run_queue = out.counter(
        "profagent_process_run_queue_seconds",
        "time the main thread of each of the group's processes was runnable but waited for a CPU "
        "(schedstat): CPU contention", GROUP,
    )
    for g in snap.groups:
        labels = [g.job_id, g.rank, g.role]
        u = g.usage
        cpu.add_metric([*labels, "user"], u.cpu_user)
        cpu.add_metric([*labels, "system"], u.cpu_system)
        if u.cpu_iowait is not None:
            cpu.add_metric([*labels, "iowait"], u.cpu_iowait)
        rss.add_metric(labels, u.rss)
        if u.uss is not None:
            uss.add_metric(labels, u.uss)
        threads.add_metric(labels, u.threads)
        procs.add_metric(labels, g.processes)
        if u.fds is not None:
            fds.add_metric(labels, u.fds)
        if u.read_bytes is not None:
            read.add_metric(labels, u.read_bytes)
        if u.write_bytes is not None:
            write.add_metric(labels, u.write_bytes)
        ctx.add_metric([*labels, "voluntary"], u.ctx_voluntary)
        ctx.add_metric([*labels, "involuntary"], u.ctx_involuntary)
        if u.run_queue is not None:
            run_queue.add_metric(labels, u.run_queue)

    node = snap.node
    out.gauge("profagent_node_cpu_utilization_ratio", "node-wide CPU utilisation (0..1)", ()).add_metric([], node.cpu_ratio)
    out.gauge("profagent_node_cpus", "logical CPUs of the node", ()).add_metric([], node.cpu_count)
    out.gauge("profagent_node_memory_total_bytes", "node memory", ()).add_metric([], node.memory_total)
    out.gauge("profagent_node_memory_available_bytes", "node memory available", ()).add_metric([], node.memory_available)

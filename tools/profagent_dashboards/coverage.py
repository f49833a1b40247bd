"""Which exported families the dashboards leave out, and why.

A metric family without a panel is unfinished work unless it is listed here with its
reason. The tests hold both lists against the renderers and a live exposition.
"""

from __future__ import annotations

from pathlib import Path

import yaml

# The job-level recording rules; the series they record are known names to the dashboards
# although no agent exports them.
RECORDING_RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "recording.yml"


def recorded_names(path: Path = RECORDING_RULES) -> dict[str, str]:
    """Series name -> expression, for every recording rule in ``path``."""
    groups = yaml.safe_load(path.read_text(encoding="utf-8"))["groups"]
    return {rule["record"]: rule["expr"] for group in groups for rule in group["rules"] if "record" in rule}

# Recorded series that no panel shows: they need dcgm-exporter beside profagent, so a
# panel would be empty on most clusters (docs/gpu.md, "Joining with dcgm-exporter").
RECORDED_NOT_ON_A_DASHBOARD: dict[str, str] = {
    name: "dcgm-exporter's series joined with profagent's: only where dcgm-exporter runs too"
    for name in ("uuid:DCGM_FI_DEV_GPU_UTIL:ratio", "uuid:DCGM_FI_DEV_FB_USED:bytes",
                 "job_id:DCGM_FI_DEV_GPU_UTIL:avg_ratio", "instance_job_id_rank_uuid:DCGM_FI_DEV_GPU_UTIL:ratio")
} | {
    name: "a step of the straggler rule: its panel shows the result (job_straggler)"
    for name in ("instance_job_id_rank:profagent_collective_wait_ratio:job_lowest",
                 "job_id:profagent_collective_wait_ratio:median_of_others",
                 "instance_job_id_rank:profagent_collective_wait_ratio:straggling",
                 "instance_job_id_rank:profagent_collective_wait_ratio:straggling_steadily",
                 "instance_job_id_rank:profagent_finding:straggler")
}

# Families that no panel shows.
NOT_ON_A_DASHBOARD: dict[str, str] = {
    "profagent_hang_rank_info": "joined across nodes by recording.yml: Job across nodes shows its culprits "
                                "(instance_job_id_rank:profagent_hang_rank_info:culprit)",
    "profagent_incidents_total": "drawn as the Incidents annotation of the Job overview (changes() of it)",
    "profagent_incidents_rate_limited_total": "incident triggers skipped by the rate limit: for ad-hoc queries",
    "profagent_incidents_traces_rejected_total": "trace files a capture refused (attacks or broken files): for ad-hoc queries",
    "profagent_traces_dir_configured": "keys the ProfagentNoTraces alert; always 1 while present",
    "profagent_collector_not_applicable": "keys the ProfagentCollectorDown alert (an off source with nothing to do here)",
    "profagent_collector_retrying": "an off source that retries by itself (the Kineto endpoint held by another user): "
                                    "its collector_up 0 fires ProfagentCollectorDown; the reason for ad-hoc queries",
    "profagent_process_threads": "threads of a rank's processes: for ad-hoc queries",
    "profagent_process_open_fds": "fd leaks are rare in training jobs: for ad-hoc queries",
    "profagent_processes": "processes per rank and role: the Ranks and roles table counts them from target_info",
    "profagent_process_io_read_bytes_total": "storage I/O of a rank: for ad-hoc queries (checkpoints show as the checkpoint_io stack category)",
    "profagent_process_io_written_bytes_total": "storage I/O of a rank: for ad-hoc queries",
    "profagent_process_context_switches_total": "scheduler detail: for ad-hoc queries",
    "profagent_node_cpu_utilization_ratio": "the node view belongs to node_exporter's dashboards",
    "profagent_node_cpus": "the node view belongs to node_exporter's dashboards",
    "profagent_node_memory_total_bytes": "the node view belongs to node_exporter's dashboards",
    "profagent_node_memory_available_bytes": "used by the ProfagentHostMemoryLeak alert; the node view belongs to node_exporter",
    "profagent_gpu_mig_info": "MIG only; per-process GPU memory carries the mig label",
    "profagent_gpu_mig_memory_used_bytes": "MIG only: for ad-hoc queries",
    "profagent_gpu_mig_memory_free_bytes": "MIG only: for ad-hoc queries",
    "profagent_gpu_mig_memory_total_bytes": "MIG only: for ad-hoc queries",
    "profagent_gpu_fan_speed_ratio": "absent on passively cooled data-centre boards, the ones training runs on",
    "profagent_gpu_retired_pages": "pre-Ampere boards only; newer ones report remapped rows (on the GPUs dashboard)",
    "profagent_trace_info": "the accelerator kind of a rank's last trace: shown by `profagent analyze`; for ad-hoc joins",
    "profagent_trace_steps_incomplete": "incomplete last steps excluded from the step time: said by `profagent analyze`; for ad-hoc queries",
    "profagent_timeline_events_total": "probe events read, foreign and lost: the timeline's own health, for ad-hoc queries",
    "profagent_timeline_probes": "probes placed per libtorch build: said by the agent's log and `profagent doctor`",
    "profagent_timeline_lost_events_total": "probe events lost where a rank ran: said by `diagnose`, `top` and the agent's log",
    "profagent_steps_per_second": "the agent's own window rate, for `top` and `diagnose`; panels use rate() of the steps counter",
    "profagent_step_micro_batches": "backward passes per step over the window, for `diagnose`; panels use rate() of both counters",
    "profagent_step_window_seconds": "the agent's own window quantiles, for `top` and `diagnose`; panels compute theirs from the histogram",
    "profagent_stack_sampler_errors_total": "py-spy failures; their effect shows as collector errors on Agent health",
    "process_virtual_memory_bytes": "the agent's virtual size says little; its resident memory is on Agent health",
    "process_start_time_seconds": "the agent's start time; restarts show as counter resets",
    "process_max_fds": "a limit, not a measurement",
    "python_info": "the agent's Python version",
    "python_gc_collections_total": "the agent's garbage collector, for debugging the agent",
    "python_gc_objects_collected_total": "the agent's garbage collector, for debugging the agent",
    "python_gc_objects_uncollectable_total": "the agent's garbage collector, for debugging the agent",
}

# Series that exist only after something went wrong, so a healthy job leaves their panels
# (and alerts) empty. Recorded series (recording.yml) count too.
ONLY_AFTER_A_FAILURE: dict[str, str] = {
    "profagent_collector_errors_total": "a collector tick failed",
    "profagent_collector_not_applicable": "a source has nothing to do on this node (no GPU, endpoint held by another agent)",
    "profagent_gpu_xid_errors_total": "the driver reported an XID",
    "profagent_stack_sampler_errors_total": "a py-spy run failed",
    **{f"profagent_collective_arrival_lag_seconds_{part}": "a job whose ranks meet in collectives (the dashboards' "
       "test job, two independent ranks, has none)" for part in ("sum", "count")},
    "job_id_severity:profagent_finding:sum": "a finding is active on a rank (profagent_finding == 1)",
    "job_id_severity:profagent_finding:distinct": "a finding is active on a rank (profagent_finding == 1)",
    "instance_job_id_rank:profagent_collective_wait_ratio:job_straggler": "a rank straggles: empty on a healthy job",
    "instance_job_id_rank:profagent_hang_rank_info:culprit": "a job hangs and an agent found its culprit",
    "profagent_series_dropped": "a job passed agent.max_series_per_job",
}

"""`envctl monitor` and `envctl top`: sampling (NVML, cgroups, psutil), exporters (CSV,
Prometheus), and the health loop that re-converges environments that drifted.

Modules: `nvml` (one NVML session kept open), `collect` (a tick's Snapshot), `csvout` (the
original setup's CSV files, rotated), `prom` (the exposition: textfile and /metrics),
`health` (checks, heals with backoff), `events` (the events log `status` shows), `daemon`
(the loop), `top` (the live view; the only module here that imports rich).
"""

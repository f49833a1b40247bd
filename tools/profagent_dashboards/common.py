"""Shared pieces of the dashboards: datasource, variables, links, panel shorthands.

Panels are built with Grafana's official ``grafana-foundation-sdk`` builders; ``finish()``
turns a built dashboard into the committed JSON model (panel ids, query refIds and the
current ``schemaVersion`` filled in deterministically, so regenerating is byte-stable).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from grafana_foundation_sdk.builders import common as gc
from grafana_foundation_sdk.builders import dashboard as gd
from grafana_foundation_sdk.builders import prometheus as gp
from grafana_foundation_sdk.builders import stat, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import prometheus as pm

from profagent.exporters.grafana.provisioning import DATASOURCE_NAME, DATASOURCE_UID

TAG = "profagent"
# Grafana 10.4 and 11.x write schemaVersion 39; both load it without migration.
SCHEMA_VERSION = 39

DS = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")


@dataclass(frozen=True)
class Board:
    """One dashboard's identity: its uid, title and file name."""

    key: str
    uid: str
    title: str

    @property
    def filename(self) -> str:
        return f"{self.uid}.json"


BOARDS: tuple[Board, ...] = (
    Board("overview", "profagent-overview", "profagent / Job overview"),
    Board("gpus", "profagent-gpus", "profagent / GPUs"),
    Board("stacks", "profagent-stacks", "profagent / Python stacks"),
    Board("traces", "profagent-traces", "profagent / Torch traces"),
    Board("agent", "profagent-agent", "profagent / Agent health"),
    Board("cluster", "profagent-cluster", "profagent / Job across nodes"),
)
BY_KEY = {b.key: b for b in BOARDS}

# Label matchers, spelled once. Every job-scoped query filters on instance and job_id;
# rank- and gpu-scoped ones add those variables.
INST = 'instance=~"$instance"'
JOB = f'{INST}, job_id=~"$job_id"'
RANK = f'{JOB}, rank=~"$rank"'
GPU = f'{INST}, gpu=~"$gpu"'

# Grafana unit ids.
SECONDS = "s"
BYTES = "bytes"
BYTES_RATE = "Bps"
PERCENT = "percentunit"  # a 0..1 ratio shown as percent
WATTS = "watt"
JOULES = "joule"
CELSIUS = "celsius"
HERTZ = "hertz"
CORES = "suffix: cores"
PER_SECOND = "ops"  # events per second
NONE = "none"


# -- variables -------------------------------------------------------------------


def _query_var(
    name: str, label: str, query: str, description: str, numeric: bool = False, all_regex: bool = True
) -> gd.QueryVariable:
    """A multi-value variable from label_values(). "All" is ``.*`` when ``all_regex`` (the
    queries already select profagent series), else the list of values (``instance``, so
    that Prometheus' own ``up`` and ``scrape_*`` series stay limited to the agents)."""
    v = (
        gd.QueryVariable(name)
        .label(label)
        .description(description)
        .datasource(DS)
        .query({"query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery", "qryType": 1})
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dm.VariableSort.NUMERICAL_ASC if numeric else dm.VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .current(dm.VariableOption(selected=True, text=["All"], value=["$__all"]))
    )
    return v.all_value(".*") if all_regex else v


def variables() -> list[gd.QueryVariable | gd.DatasourceVariable]:
    """datasource, instance, job_id, rank and gpu, each narrowing the next."""
    datasource = (
        gd.DatasourceVariable("datasource")
        .label("Datasource")
        .type("prometheus")
        .current(dm.VariableOption(selected=True, text=DATASOURCE_NAME, value=DATASOURCE_UID))
    )
    return [
        datasource,
        _query_var("instance", "Node", "label_values(profagent_build_info, instance)",
                   "the agent's scrape target (one per node)", all_regex=False),
        _query_var("job_id", "Job", f"label_values(profagent_target_up{{{INST}}}, job_id)",
                   "SLURM_JOB_ID, else TORCHELASTIC_RUN_ID, else the launcher PID"),
        _query_var("rank", "Rank", f'label_values(profagent_target_info{{{JOB}, role="main"}}, rank)',
                   "global rank (RANK, else SLURM_PROCID)", numeric=True),
        _query_var("gpu", "GPU", f"label_values(profagent_gpu_info{{{INST}}}, gpu)", "NVML device index", numeric=True),
    ]


def job_variables(query: str) -> list[gd.QueryVariable | gd.DatasourceVariable]:
    """datasource and job_id only, job ids from ``query`` (a label_values() over recorded
    series): for dashboards built on the job-level recording rules, which span every node."""
    datasource, *_ = variables()
    return [
        datasource,
        _query_var("job_id", "Job", query, "SLURM_JOB_ID, else TORCHELASTIC_RUN_ID, else the launcher PID"),
    ]


def links(current: Board) -> list[gd.DashboardLink]:
    """A link to every other profagent dashboard, carrying the variables and time range."""
    out = []
    for board in BOARDS:
        if board.uid == current.uid:
            continue
        out.append(
            gd.DashboardLink(board.title.split(" / ", 1)[1])
            .type(dm.DashboardLinkType.LINK)
            .url(f"/d/{board.uid}")
            .icon("dashboard")
            .tooltip(board.title)
            .include_vars(True)
            .keep_time(True)
        )
    return out


def dashboard(
    board: Board, description: str, board_variables: Sequence[gd.QueryVariable | gd.DatasourceVariable] = ()
) -> gd.Dashboard:
    """A dashboard with the shared settings and links; ``board_variables`` default to
    :func:`variables`."""
    b = (
        gd.Dashboard(board.title)
        .uid(board.uid)
        .description(description)
        .tags([TAG])
        .editable()
        .timezone("browser")
        .time("now-1h", "now")
        .refresh("30s")
        .tooltip(dm.DashboardCursorSync.CROSSHAIR)
        .variables(list(board_variables) or variables())
        .links(links(board))
    )
    return b


# -- queries and panels --------------------------------------------------------------


def q(expr: str, legend: str = "", instant: bool = False, table_format: bool = False) -> gp.Dataquery:
    """One PromQL target. ``instant`` for stats and tables (the value now)."""
    target = gp.Dataquery().expr(expr).datasource(DS)
    if legend:
        target = target.legend_format(legend)
    if instant:
        target = target.instant()
    else:
        target = target.range()
    if table_format:
        target = target.format(pm.PromQueryFormat.TABLE)
    return target


def ts(
    title: str,
    unit: str,
    targets: Sequence[gp.Dataquery],
    description: str,
    *,
    width: int = 12,
    height: int = 8,
    stacked: bool = False,
    max_value: float | None = None,
    repeat: str = "",
) -> timeseries.Panel:
    """A time series panel (lines, or stacked areas that add up to a whole)."""
    p = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DS)
        .unit(unit)
        .min(0)
        .span(width)
        .height(height)
        .line_width(1)
        .fill_opacity(40 if stacked else 10)
        .legend(
            gc.VizLegendOptions()
            .display_mode(cm.LegendDisplayMode.TABLE)
            .placement(cm.LegendPlacement.BOTTOM)
            .show_legend(True)
            .calcs(["mean", "max", "lastNotNull"])
        )
        .tooltip(gc.VizTooltipOptions().mode(cm.TooltipDisplayMode.MULTI).sort(cm.SortOrder.DESCENDING))
    )
    if stacked:
        p = p.stacking(gc.StackingConfig().mode(cm.StackingMode.NORMAL))
    if max_value is not None:
        p = p.max(max_value)
    if repeat:
        p = p.repeat(repeat).repeat_direction("h")
    for t in targets:
        p = p.with_target(t)
    return p


def stat_panel(
    title: str,
    unit: str,
    targets: Sequence[gp.Dataquery],
    description: str,
    *,
    width: int = 6,
    height: int = 4,
    mappings: Sequence[dm.ValueMapping] = (),
    thresholds: Sequence[tuple[float | None, str]] = ((None, "green"),),
) -> stat.Panel:
    """A single-number panel, coloured by thresholds (value -> colour, first one is the base)."""
    p = (
        stat.Panel()
        .title(title)
        .description(description)
        .datasource(DS)
        .unit(unit)
        .span(width)
        .height(height)
        .color_mode(cm.BigValueColorMode.BACKGROUND)
        .graph_mode(cm.BigValueGraphMode.NONE)
        .reduce_options(gc.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .thresholds(
            gd.ThresholdsConfig()
            .mode(dm.ThresholdsMode.ABSOLUTE)
            .steps([dm.Threshold(value=v, color=c) for v, c in thresholds])
        )
    )
    if mappings:
        p = p.mappings(list(mappings))
    for t in targets:
        p = p.with_target(t)
    return p


def up_mappings(ok: str = "UP", bad: str = "DOWN") -> list[dm.ValueMapping]:
    return [
        dm.ValueMap(options={
            "0": dm.ValueMappingResult(text=bad, color="red", index=0),
            "1": dm.ValueMappingResult(text=ok, color="green", index=1),
        })
    ]


def table_panel(
    title: str,
    unit: str,
    targets: Sequence[gp.Dataquery],
    description: str,
    *,
    width: int = 12,
    height: int = 8,
    hide: Sequence[str] = ("Time",),
    rename: dict[str, str] | None = None,
    sort_by: str = "",
    merge: bool = False,
    overrides: dict[str, str] | None = None,
    coloured: dict[str, Sequence[tuple[float | None, str]]] | None = None,
) -> table.Panel:
    """An instant table: one row per series, the value column renamed and sorted.

    ``merge`` joins several queries' value columns into one row per label set;
    ``overrides`` gives a column (by its displayed name) its own unit; ``coloured`` gives
    a column a cell background from thresholds (value -> colour, first one is the base).
    """
    p = table.Panel().title(title).description(description).datasource(DS).unit(unit).span(width).height(height)
    if merge:
        p = p.with_transformation(dm.DataTransformerConfig(id_val="merge", options={}))
    for column, column_unit in (overrides or {}).items():
        p = p.override_by_name(column, [dm.DynamicConfigValue(id_val="unit", value=column_unit)])
    for column, steps in (coloured or {}).items():
        p = p.override_by_name(column, [
            dm.DynamicConfigValue(id_val="custom.cellOptions", value={"type": "color-background", "mode": "basic"}),
            dm.DynamicConfigValue(id_val="thresholds", value={
                "mode": "absolute", "steps": [{"value": v, "color": c} for v, c in steps],
            }),
        ])
    p = (
        p.with_transformation(
            dm.DataTransformerConfig(
                id_val="organize",
                options={
                    "excludeByName": {name: True for name in hide},
                    "renameByName": dict(rename or {}),
                },
            )
        )
    )
    if sort_by:
        p = p.sort_by([gc.TableSortByFieldState().display_name(sort_by).desc(True)])
    for t in targets:
        p = p.with_target(t)
    return p


def row(title: str) -> gd.Row:
    return gd.Row(title)


# -- the committed JSON ------------------------------------------------------------


def _finish_panels(panels: list[dict], next_id: int) -> int:
    for panel in panels:
        panel["id"] = next_id
        next_id += 1
        if panel.get("options") is None:
            panel["options"] = {}
        if panel.get("repeat"):
            panel["maxPerRow"] = 4  # not in the SDK's 10.1 model
        for i, target in enumerate(panel.get("targets") or []):
            target["refId"] = chr(ord("A") + i)
        next_id = _finish_panels(panel.get("panels") or [], next_id)
    return next_id


def finish(builder: gd.Dashboard) -> dict:
    """The dashboard model as Grafana stores it, with deterministic ids and refIds."""
    model = builder.build()
    model.schema_version = SCHEMA_VERSION
    data = json.loads(JSONEncoder(sort_keys=True).encode(model))
    _finish_panels(data["panels"], 1)
    for var in data.get("templating", {}).get("list", []):
        var.pop("id", None)  # the SDK's placeholder UUID; Grafana keys variables by name
        if isinstance(var.get("query"), dict):
            var["definition"] = var["query"]["query"]  # what Grafana's variable editor shows
        if var.get("type") != "interval":
            for key in ("auto", "auto_count", "auto_min"):
                var.pop(key, None)
    data["id"] = None
    data["version"] = 1
    return data


def dumps(model: dict) -> str:
    """Stable text for a committed JSON file."""
    return json.dumps(model, indent=2, sort_keys=True, ensure_ascii=False) + "\n"

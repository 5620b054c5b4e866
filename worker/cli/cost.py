"""``sift cost``: what reranking cost over the last hour or day, read from Prometheus.

    sift cost --window 1d --png cost.png
    sift cost --json

Counter totals are exact: each series' raw samples in the window are summed increase by
increase, a counter reset counted as a restart from zero, with no extrapolation. So they can be
a little lower than Grafana's ``increase()``, which extrapolates to the window's edges. A series
that first appears inside the window (a new worker instance) counts from its first scrape: what
it did before that scrape (up to a scrape interval of work; its series start at zero) is left
out, as Prometheus's own ``increase()`` leaves it out. Latency
percentiles are Prometheus's ``histogram_quantile`` estimates over the window, one set per lane:
an economy rerank takes minutes to hours, and mixed in it would hide the standard lane's
seconds. Calls to a model with no price (``sift_rerank_unpriced_calls_total``) add nothing to
the cost counter, so the report says so when there were any: its dollars are then too low.
Attempts sent that got no answer read (``sift_rerank_unread_attempts_total``: a timeout, a
connection lost) may have been billed with no usage to say so: the report gives them and their
estimated input tokens (``sift_rerank_unread_input_tokens_total``) apart, as what the provider
may have billed on top of its figures: at most about that much input, and their output. It
prices that input at each model's input price in ``SIFT_PRICES`` as this command reads it (the
economy lane's at the Message Batches discount), an estimate: the tokens are, and the output
such a call made is in no figure at all.
"""

from __future__ import annotations

import itertools
import json
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.table import Table

from worker.cli._app import app
from worker.cli._common import (
    EXIT_ERROR,
    _err,
    cli_settings,
    one_of,
    setting_help,
    why_unwritable,
)
from worker.cli._output import counted, plain
from worker.constants import (
    ECONOMY_PRICE_DISCOUNT,
    LANE_ECONOMY,
    METRIC_RERANK_ATTEMPTS,
    METRIC_RERANK_COST,
    METRIC_RERANK_DURATION,
    METRIC_RERANK_OUTCOMES,
    METRIC_RERANK_TOKENS,
    METRIC_RERANK_UNPRICED,
    METRIC_RERANK_UNREAD,
    METRIC_RERANK_UNREAD_INPUT,
    METRIC_SEARCH_DURATION,
)
from worker.core.cost import price_for
from worker.errors import SiftError
from worker.prices import DEFAULT_PRICES, Price
from worker.settings import Settings

console = Console(emoji=False)

QUANTILES = {"p50": 0.5, "p95": 0.95, "p99": 0.99}


#: How far back the report may look, in Prometheus's duration syntax
WINDOWS = ("1h", "1d")


@dataclass(frozen=True)
class CostReport:
    """What reranking did and cost in one window, summed over every scraped process."""

    window: str
    cost_by_model: dict[str, float]
    tokens_by_type: dict[str, float]
    outcomes: dict[str, float]
    attempts: dict[str, float]
    searches: float
    latency: dict[str, dict[str, float | None]]  # lane -> percentile -> seconds
    unpriced_calls: float = 0.0  # calls whose cost is unknown, so missing from cost_by_model
    # the same dollars by lane: the economy lane's are at the Message Batches price (half)
    cost_by_lane: dict[str, float] = field(default_factory=dict)
    # attempts sent that got no answer read, and their estimated input tokens: possibly
    # billed, in no figure above
    unread_attempts: float = 0.0
    unread_input_tokens: float = 0.0
    # that input's dollars at its models' input prices, an estimate (unread_input_cost); the
    # tokens of those to a model with no price are in no dollar figure
    unread_input_cost: float = 0.0
    unread_unpriced_tokens: float = 0.0

    @property
    def total_cost(self) -> float:
        return sum(self.cost_by_model.values())

    @property
    def cost_per_1k_searches(self) -> float | None:
        return 1000 * self.total_cost / self.searches if self.searches else None


class PrometheusClient:
    """Instant queries against Prometheus's HTTP API; errors become SiftError."""

    def __init__(self, url: str, timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.Client(timeout=timeout)

    def __enter__(self) -> PrometheusClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self._http.close()

    def query(self, expr: str) -> list[dict[str, Any]]:
        try:
            response = self._http.get(f"{self.url}/api/v1/query", params={"query": expr})
            body = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise SiftError(
                f"Prometheus at {self.url} (--prometheus-url, SIFT_PROMETHEUS_URL) "
                f"did not answer: {exc}"
            ) from exc
        if body.get("status") != "success":
            raise SiftError(f"Prometheus refused {expr!r}: {body.get('error', body)}")
        result: list[dict[str, Any]] = body["data"]["result"]
        return result


def counter_increase(values: Sequence[float]) -> float:
    """The exact increase over consecutive samples; a drop is a reset, counted from zero.

    >>> counter_increase([2.0, 5.0, 1.0, 3.0])
    6.0
    """
    total = 0.0
    for previous, current in itertools.pairwise(values):
        total += current - previous if current >= previous else current
    return total


def increases_by(
    client: PrometheusClient, metric: str, window: str, label: str
) -> dict[str, float]:
    """Each ``label`` value's exact increase of ``metric`` in the window, over all its series."""
    by = increases_by_labels(client, metric, window, (label,))
    return {values[0]: increase for values, increase in by.items()}


def increases_by_labels(
    client: PrometheusClient, metric: str, window: str, labels: tuple[str, ...]
) -> dict[tuple[str, ...], float]:
    """Each ``labels`` values' exact increase of ``metric`` in the window, over all its series."""
    totals: dict[tuple[str, ...], float] = defaultdict(float)
    for series in client.query(f"{metric}[{window}]"):
        values = [float(v) for _, v in series["values"]]
        totals[tuple(series["metric"].get(label, "") for label in labels)] += counter_increase(
            values
        )
    return dict(totals)


def unread_input_cost(
    tokens: Mapping[tuple[str, ...], float], prices: Mapping[str, Price]
) -> tuple[float, float]:
    """The dollars of the unread attempts' estimated input tokens by (model, lane), each at
    its model's input price, the economy lane's at the Message Batches discount (as the
    workers price a call they read); and the tokens of models with no price, in no dollars.

    >>> haiku = Price(input=1, output=5, cache_read=0.1, cache_creation=1.25)
    >>> unread_input_cost(
    ...     {("claude-haiku-4-5", "economy"): 2e6, ("claude-x", "standard"): 7.0},
    ...     {"claude-haiku-4-5": haiku},
    ... )
    (1.0, 7.0)
    """
    dollars = unpriced = 0.0
    for (model, lane), count in tokens.items():
        price = price_for(model, prices)
        if price is None:
            unpriced += count
            continue
        discount = ECONOMY_PRICE_DISCOUNT if lane == LANE_ECONOMY else 1.0
        dollars += count * price.input * discount / 1_000_000
    return dollars, unpriced


def fetch_report(url: str, window: str, prices: Mapping[str, Price] = DEFAULT_PRICES) -> CostReport:
    """Read one window's report from the Prometheus at ``url``; ``prices`` (``SIFT_PRICES``)
    price the unread attempts' input (the cost counter's dollars are the workers' own)."""
    with PrometheusClient(url) as client:
        latency: dict[str, dict[str, float | None]] = defaultdict(dict)
        for name, q in QUANTILES.items():
            expr = (
                f"histogram_quantile({q}, sum by (le, lane) "
                f"(rate({METRIC_RERANK_DURATION}_bucket[{window}])))"
            )
            for series in client.query(expr):
                seconds = float(series["value"][1])
                lane = series["metric"].get("lane", "")
                latency[lane][name] = seconds if math.isfinite(seconds) else None
        searches = increases_by(client, f"{METRIC_SEARCH_DURATION}_count", window, "__none__")
        unpriced = increases_by(client, METRIC_RERANK_UNPRICED, window, "__none__")
        unread = increases_by(client, METRIC_RERANK_UNREAD, window, "__none__")
        unread_input = increases_by_labels(
            client, METRIC_RERANK_UNREAD_INPUT, window, ("model", "lane")
        )
        unread_cost, unread_unpriced = unread_input_cost(unread_input, prices)
        return CostReport(
            window=window,
            cost_by_model=increases_by(client, METRIC_RERANK_COST, window, "model"),
            cost_by_lane=increases_by(client, METRIC_RERANK_COST, window, "lane"),
            tokens_by_type=increases_by(client, METRIC_RERANK_TOKENS, window, "type"),
            outcomes=increases_by(client, METRIC_RERANK_OUTCOMES, window, "outcome"),
            attempts=increases_by(client, METRIC_RERANK_ATTEMPTS, window, "result"),
            searches=sum(searches.values()),
            latency=dict(latency),
            unpriced_calls=sum(unpriced.values()),
            unread_attempts=sum(unread.values()),
            unread_input_tokens=sum(unread_input.values()),
            unread_input_cost=unread_cost,
            unread_unpriced_tokens=unread_unpriced,
        )


# --- rendering -----------------------------------------------------------------------------------


def as_json(report: CostReport, url: str) -> dict[str, Any]:
    """The report as ``--json`` prints it: every field, the totals it derives, and its source
    (a latency percentile Prometheus could not estimate is null)."""
    return {
        "prometheus_url": url,
        **asdict(report),
        "total_cost": report.total_cost,
        "cost_per_1k_searches": report.cost_per_1k_searches,
    }


def _count_table(title: str, label: str, counts: Mapping[str, float]) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column(label)
    table.add_column("count", justify="right")
    table.add_column("share", justify="right")
    total = sum(counts.values())
    for key, value in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        share = f"{value / total:.1%}" if total else "-"
        table.add_row(key, f"{value:,.0f}", share)
    table.add_row("[bold]total[/]", f"[bold]{total:,.0f}[/]", "")
    return table


def render(report: CostReport, url: str) -> Iterable[Table | str]:
    yield f"[bold]Rerank cost, last {report.window}[/] (from {url})"
    cost = Table(title="Cost (USD, SIFT_PRICES)", title_justify="left")
    cost.add_column("model")
    cost.add_column("USD", justify="right")
    for model, usd in sorted(report.cost_by_model.items()):
        cost.add_row(plain(model), f"{usd:.6f}")
    cost.add_row("[bold]total[/]", f"[bold]{report.total_cost:.6f}[/]")
    for lane, usd in sorted(report.cost_by_lane.items()):
        note = " (Message Batches: half price)" if lane == "economy" else ""
        cost.add_row(f"{plain(lane)} lane{note}", f"{usd:.6f}")
    per_1k = report.cost_per_1k_searches
    cost.add_row(
        f"per 1,000 searches ({counted(report.searches, 'search', 'searches')})",
        f"{per_1k:.6f}" if per_1k is not None else "-",
    )
    yield cost
    if report.unpriced_calls:
        yield (
            f"[yellow]warning:[/] {report.unpriced_calls:,.0f} model calls were to a model with "
            "no price in SIFT_PRICES: their cost is unknown and not in the figures above, "
            "which are too low"
        )
    if report.unread_attempts:
        unpriced = (
            f"; {report.unread_unpriced_tokens:,.0f} of those tokens, to a model with no price "
            "in SIFT_PRICES, are not in it"
            if report.unread_unpriced_tokens
            else ""
        )
        yield (
            f"possibly billed, not read: {report.unread_attempts:,.0f} attempts sent that got "
            "no answer (a timeout, a connection lost): the provider may have billed them, at "
            f"most about {report.unread_input_tokens:,.0f} input tokens by estimate, about "
            f"{report.unread_input_cost:.6f} USD at the input price (an estimate; the economy "
            f"lane's at half{unpriced}), and what output they made; no figure above holds them"
        )
    yield _count_table("Tokens by type (summed: billed)", "type", report.tokens_by_type)
    yield _count_table("Rerank outcomes", "outcome", report.outcomes)
    yield _count_table("Attempts by class", "result", report.attempts)
    latency = Table(title="Rerank latency (seconds), by lane", title_justify="left")
    latency.add_column("lane")
    lanes = sorted(report.latency)
    for name in QUANTILES:
        latency.add_column(name, justify="right")
    for lane in lanes:
        found = report.latency[lane]
        cells = [found.get(name) for name in QUANTILES]
        latency.add_row(lane, *(f"{v:.3f}" if v is not None else "-" for v in cells))
    yield latency


def _figure_class() -> Any:
    """matplotlib's ``Figure``; SiftError naming the extra to install when it is missing."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise SiftError("--png needs matplotlib: pip install 'sift[charts]'") from exc
    return Figure


def check_png(path: Path) -> None:
    """Refuse a ``--png`` that cannot be written (matplotlib missing, its folder not there or
    not writable) before Prometheus is read: the report was printed whole first, then the
    error, and a ``sift cost --png x > report.txt`` kept a report that looked done from a run
    that failed. Makes no folder (a typo's folder would be left behind); a failure while
    writing still comes after the report (a disk full meanwhile). An existing path is
    checked itself: a folder, or a file it may not write, passed its folder's check and
    failed after the report; it is opened to append, so nothing in it changes."""
    _figure_class()
    why = why_unwritable(path, in_place=True)
    if why is not None:
        raise SiftError(f"--png: cannot write {path} ({why}); nothing was read")


def chart_title(report: CostReport) -> str:
    """The chart's title: the cost, and, on a line of their own, the calls it leaves out
    (unpriced ones, and the attempts possibly billed and not read, at their estimate)."""
    per_1k = report.cost_per_1k_searches
    title = (
        f"Sift rerank, last {report.window}: {report.total_cost:.4f} USD"
        + (f", {per_1k:.4f} USD per 1,000 searches" if per_1k is not None else "")
        + (
            f" ({report.unpriced_calls:,.0f} unpriced calls: too low)"
            if report.unpriced_calls
            else ""
        )
    )
    if report.unread_attempts:
        title += (
            f"\npossibly billed, not read: {report.unread_attempts:,.0f} attempts, about "
            f"{report.unread_input_cost:.4f} USD of input (estimate), not in the figures"
        )
    return title


def write_chart(report: CostReport, path: Path) -> None:
    """A PNG of the report: cost, tokens, attempts and outcomes. Needs ``sift[charts]``."""
    figure = _figure_class()(figsize=(11, 8), layout="constrained")
    figure.suptitle(chart_title(report))
    panels = [
        ("Cost by model (USD)", report.cost_by_model),
        ("Tokens by type", report.tokens_by_type),
        ("Attempts by class", report.attempts),
        ("Rerank outcomes", report.outcomes),
    ]
    for axes, (title, data) in zip(figure.subplots(2, 2).flat, panels, strict=True):
        names = sorted(data)
        axes.barh(names, [data[n] for n in names], color="#3274d9")
        axes.set_title(title)
        axes.invert_yaxis()
    figure.savefig(path, format="png", dpi=100)


def _settings(option: str | None) -> Settings:
    """The settings, with the option's URL, else SIFT_PROMETHEUS_URL's; the option is checked
    as the setting is, and a bad one is a usage error naming it (exit 2), not a Prometheus
    that did not answer."""
    overrides = {} if option is None else {"prometheus_url": option}
    return cli_settings(options={"prometheus_url": "--prometheus-url"}, **overrides)


@app.command("cost")
def cost_command(
    prometheus_url: Annotated[
        str | None,
        typer.Option(help=setting_help("Prometheus base URL", "SIFT_PROMETHEUS_URL")),
    ] = None,
    window: Annotated[
        str, typer.Option(callback=one_of(WINDOWS), help="how far back to look: 1h or 1d")
    ] = "1h",
    png: Annotated[
        Path | None, typer.Option(dir_okay=False, help="also write a PNG chart to this file")
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
) -> None:
    """Rerank cost, tokens, outcomes, attempts and latency of the last hour or day."""
    try:
        settings = _settings(prometheus_url)
        url = settings.prometheus_url
        if png is not None:
            check_png(png)
        report = fetch_report(url, window, settings.prices)
        if json_out:
            typer.echo(json.dumps(as_json(report, url)))
        else:
            for item in render(report, url):
                console.print(item)
    except SiftError as exc:
        _err().print(f"[red]error:[/] {plain(exc.message)}", soft_wrap=True)
        raise typer.Exit(EXIT_ERROR) from exc
    if png is not None:
        try:
            write_chart(report, png)
        except OSError as exc:  # writable when checked, not now (the disk full): report whole
            _err().print(
                f"[red]error:[/] --png: cannot write {plain(str(png))} "
                f"({plain(exc.strerror or exc)}); the report printed is complete"
            )
            raise typer.Exit(EXIT_ERROR) from exc
        _err().print(f"wrote [bold]{plain(str(png))}[/]")  # stdout may be --json's

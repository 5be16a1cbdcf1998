"""Prometheus metrics of a server: request-level ones observed by the front end, engine and rank
counters read from the replicas' latest reports at scrape time."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

disable_created_metrics()  # no *_created series: scrapes stay small and readable

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("afd_requests", "Requests ended, by finish reason (stop, length; abort: client gone; rejected; error: a rank failed or the shutdown deadline)", ["finish_reason"], registry=r)
        self.http_errors = Counter("afd_http_errors", "Requests answered with an error status", ["status"], registry=r)
        self.prompt_tokens = Counter("afd_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("afd_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("afd_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("afd_inter_token_latency_seconds", "Time between a request's tokens", buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("afd_request_latency_seconds", "Request latency, end to end", buckets=LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge("afd_requests_in_flight", "Requests the front end is serving", registry=r)
        self.requests_moved = Counter("afd_requests_moved", "Requests moved from a lost replica to another (resumed from what "
                                      "they had streamed)", registry=r)
        self.rebalance_checks = Counter("afd_rebalance_checks", "Checks of the FFN load by --rebalance-every", registry=r)

    def bind(self, frontend) -> None:
        """Export the replicas' and ranks' counters, read from ``frontend`` at each scrape."""
        self.registry.register(_EngineCollector(frontend))

    # called by the front end (asyncio thread)
    def request_started(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)
        self.in_flight.inc()

    def token(self, stream, now: float) -> None:
        self.generation_tokens.inc()
        if stream.last_token_at is None:
            self.ttft.observe(now - stream.created)
        else:
            self.itl.observe(now - stream.last_token_at)

    def request_finished(self, reason: str, stream) -> None:
        self.requests.labels(reason).inc()
        self.latency.observe(time.perf_counter() - stream.created)
        self.in_flight.dec()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Queue depth, KV blocks, preemptions, busy time, connector traffic, per-expert tokens."""

    def __init__(self, frontend) -> None:
        self.frontend = frontend

    def collect(self):
        stats = list(enumerate(self.frontend.replica_stats))
        status = self.frontend.client.status()
        ffn = status.ffn_stats

        def gauge(name, doc, key, labels=("replica",)):
            g = GaugeMetricFamily(name, doc, labels=list(labels))
            for i, s in stats:
                if key in s:
                    g.add_metric([str(i)], s[key])
            return g

        yield gauge("afd_queue_depth", "Requests waiting for admission", "waiting")
        yield gauge("afd_running_seqs", "Sequences being generated", "running")
        yield gauge("afd_kv_blocks_used", "KV cache blocks in use", "kv_blocks_used")
        yield gauge("afd_kv_blocks_total", "KV cache blocks in the pool", "kv_blocks_total")
        yield gauge("afd_kv_blocks_peak", "Most KV cache blocks in use at once", "kv_blocks_peak")
        pre = CounterMetricFamily("afd_preemptions", "Requests preempted (KV blocks ran out; recomputed later)", labels=["replica"])
        steps = CounterMetricFamily("afd_engine_steps", "Engine steps run", labels=["replica"])
        for i, s in stats:
            if "preemptions" in s:
                pre.add_metric([str(i)], s["preemptions"])
                steps.add_metric([str(i)], s["steps"])
        yield pre
        yield steps
        queries = CounterMetricFamily("afd_prefix_cache_queries", "Prompt tokens of admitted requests looked up in the prefix cache",
                                      labels=["replica"])
        hits = CounterMetricFamily("afd_prefix_cache_hits", "Of those, tokens whose KV came from the cache (not computed)",
                                   labels=["replica"])
        for i, s in stats:
            if "prefix_cache_queries" in s:
                queries.add_metric([str(i)], s["prefix_cache_queries"])
                hits.add_metric([str(i)], s["prefix_cache_hits"])
        yield queries
        yield hits
        busy = CounterMetricFamily("afd_busy_seconds", "Time each role spent computing", labels=["role", "rank"])
        for i, s in stats:
            if "busy_s" in s:
                busy.add_metric(["attention" if "connector_round_trips" in s else "monolithic", str(i)], s["busy_s"])
        ffn_cpu = CounterMetricFamily("afd_ffn_cpu_seconds", "CPU time of each FFN rank's computing thread (busy_seconds is wall time)",
                                      labels=["rank"])
        ffn_process_cpu = CounterMetricFamily("afd_ffn_process_cpu_seconds", "CPU time of each FFN rank's whole process: its "
                                              "computing plus receiving, checking and answering parts, heartbeats", labels=["rank"])
        for name, s in ffn.items():
            busy.add_metric(["ffn", name.rsplit(" ", 1)[-1]], s["busy_s"])
            ffn_cpu.add_metric([name.rsplit(" ", 1)[-1]], s["busy_cpu_s"])
            ffn_process_cpu.add_metric([name.rsplit(" ", 1)[-1]], s.get("process_cpu_s", 0.0))
        yield busy
        yield ffn_cpu
        yield ffn_process_cpu
        nbytes = CounterMetricFamily("afd_connector_bytes", "Bytes over the attention-FFN links", labels=["rank", "direction"])
        rtt = CounterMetricFamily("afd_connector_round_trip_seconds", "Dispatch to combine, summed (divide by _round_trips)", labels=["rank"])
        trips = CounterMetricFamily("afd_connector_round_trips", "Dispatch-combine round trips completed", labels=["rank"])
        wait = CounterMetricFamily("afd_connector_wait_seconds", "Time attention ranks were blocked on combine", labels=["rank"])
        for i, s in stats:
            if "connector_round_trips" in s:
                nbytes.add_metric([str(i), "sent"], s["connector_bytes_sent"])
                nbytes.add_metric([str(i), "received"], s["connector_bytes_received"])
                rtt.add_metric([str(i)], s["connector_round_trip_s"])
                trips.add_metric([str(i)], s["connector_round_trips"])
                wait.add_metric([str(i)], s["connector_wait_s"])
        yield nbytes
        yield rtt
        yield trips
        yield wait
        sent = CounterMetricFamily("afd_connector_rows_sent", "Rows each attention rank sent each FFN rank (what the FFN rank's "
                                   "afd_ffn_rows add up to once it has answered everything)", labels=["rank", "ffn"])
        for i, s in stats:
            for ffn_rank, n in (s.get("connector_rows_sent") or {}).items():
                sent.add_metric([str(i), str(ffn_rank)], n)
        yield sent
        redo = CounterMetricFamily("afd_connector_redispatched", "In-flight (step, layer, micro-batch) units sent again to surviving "
                                   "expert copies after an FFN rank was lost", labels=["rank"])
        stale = CounterMetricFamily("afd_connector_stale_results", "Results of a re-dispatched attempt that arrived and were dropped",
                                    labels=["rank"])
        for i, s in stats:
            if "connector_redispatched" in s:
                redo.add_metric([str(i)], s["connector_redispatched"])
                stale.add_metric([str(i)], s["connector_stale_results"])
        yield redo
        yield stale
        if status.disaggregated:
            gone = CounterMetricFamily("afd_replicas_lost", "Attention ranks lost while serving (their requests moved, or waited "
                                       "for a restart)")
            gone.add_metric([], len(status.replica_losses))
            yield gone
            again = CounterMetricFamily("afd_replicas_restarted", "Lost attention ranks restarted and back in use")
            again.add_metric([], len(status.replica_restarts))
            yield again
            lost = CounterMetricFamily("afd_ffn_ranks_lost", "FFN ranks the run went on without (died, or killed when found hung)")
            lost.add_metric([], len(status.ffn_losses))
            yield lost
            back = CounterMetricFamily("afd_ffn_replacements", "Replacement FFN ranks started after a loss and back in use")
            back.add_metric([], len(status.ffn_replacements))
            yield back
            moves = CounterMetricFamily("afd_rebalances", "Expert placements recomputed from measured load and moved to")
            moves.add_metric([], len(status.rebalances))
            yield moves
            version = GaugeMetricFamily("afd_placement_version", "The expert placement version every rank uses")
            version.add_metric([], status.placement_version)
            yield version
        rows = GaugeMetricFamily("afd_ffn_mean_gemm_rows", "Mean rows per expert GEMM on each FFN rank", labels=["rank"])
        items = GaugeMetricFamily("afd_ffn_items_per_batch", "Mean non-empty parts (attention ranks) per computed union", labels=["rank"])
        batches = CounterMetricFamily("afd_ffn_batches", "(step, layer, micro-batch) unions computed", labels=["rank"])
        ffn_rows = CounterMetricFamily("afd_ffn_rows", "Rows (tokens) the FFN rank computed, over all unions", labels=["rank"])
        straggler = CounterMetricFamily("afd_ffn_straggler_wait_seconds",
                                        "Summed over unions: first part received to last part received", labels=["rank"])
        for name, s in ffn.items():
            rank = name.rsplit(" ", 1)[-1]
            rows.add_metric([rank], s["mean_gemm_rows"])
            items.add_metric([rank], s["items_per_batch"])
            batches.add_metric([rank], s["batches"])
            ffn_rows.add_metric([rank], s["tokens"])
            straggler.add_metric([rank], s["straggler_wait_s"])
        retries = CounterMetricFamily("afd_ffn_retries", "Re-dispatched parts (Op.RETRY) the FFN rank computed", labels=["rank"])
        idle = GaugeMetricFamily("afd_ffn_idle", "1 when the FFN rank's last report came with no work waiting: its counters "
                                 "have settled", labels=["rank"])
        for name, s in ffn.items():
            retries.add_metric([name.rsplit(" ", 1)[-1]], s.get("retries", 0))
            idle.add_metric([name.rsplit(" ", 1)[-1]], 1.0 if s.get("idle") else 0.0)
        yield idle
        yield rows
        yield items
        yield batches
        yield ffn_rows
        yield straggler
        yield retries
        loads = [s["tokens"] for s in ffn.values()]
        if loads and sum(loads):
            imbalance = GaugeMetricFamily("afd_ffn_load_max_over_mean", "Most rows any FFN rank computed over the mean (1.0: balanced)")
            imbalance.add_metric([], max(loads) / (sum(loads) / len(loads)))
            yield imbalance
        experts = CounterMetricFamily("afd_expert_tokens", "Tokens computed by each routed expert", labels=["layer", "expert"])
        totals: dict[tuple[int, int], int] = {}
        for source in [s for _, s in stats] + list(ffn.values()):
            for key, n in (source.get("expert_tokens") or {}).items():
                totals[key] = totals.get(key, 0) + n
        for (layer, expert), n in sorted(totals.items()):
            experts.add_metric([str(layer), str(expert)], n)
        yield experts

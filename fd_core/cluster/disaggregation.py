"""Prefill/decode disaggregation (``--scheduler-name splitwise --role prefill|decode``): a
prefill instance computes a request's prompt and samples its first token, which goes to the
requester at once; then it picks a decode instance (``GlobalScheduler.choose``, FastDeploy's
policy: at random among the lightly loaded), makes it the request's owner in Redis, and sends
it the request and its prompt's KV blocks through the KV-cache connector
(``fd_core.interfaces.kv_transfer``). The decode instance admits it with those blocks written
into its cache and decodes on from the first token; it computes no prompt token.

A decode instance that dies with handed-over requests is reaped as any instance is (they end
with an error to their requesters). A transfer that fails (no acknowledgement in time) is
tried once more on another decode instance; then the request ends with an error naming both.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import msgspec

from fd_core.cluster.config import SchedulerConfig
from fd_core.cluster.global_scheduler import GlobalScheduler, Load
from fd_core.cluster.role import Role
from fd_core.engine.core import Prefilled
from fd_core.engine.wire import AddRequest, Failed, params_from_wire
from fd_core.errors import ConfigError, SchedulerUnavailableError
from fd_core.interfaces.kv_transfer import KVTransferError, TransferDone

log = logging.getLogger("fd.cluster")

TRANSFER_TIMEOUT_S = 30.0  # a send not acknowledged by then counts as failed
TRIES = 2  # decode instances a request's KV cache is sent to before it fails
ABORT_MEMORY_S = 60.0  # how long a decode instance remembers an abort for a request not arrived yet
# a prefill instance pulls no new request while every decode instance of its layout has this
# many sequences per slot (running and waiting): their KV caches would only wait there, in host memory
DECODE_BACKLOG = 2.0
BACKLOG_CHECK_S = 0.5


class Handover(msgspec.Struct, array_like=True):
    """What travels with a request's KV blocks (the connector's header)."""

    request_id: str
    origin: str  # where its outputs go
    payload: bytes  # its AddRequest, as the requester queued it
    first_token: int
    seed: int
    num_cached_tokens: int
    layout: str  # kv_layout() of the prefill instance
    ranks: int  # the arrays are this many ranks' in turn
    prefill: str  # the instance that computed the prompt


@dataclasses.dataclass
class TransferStats:
    """Requests whose KV cache this instance sent (prefill) or received (decode), their bytes,
    and the seconds sends took until acknowledged (prefill only)."""

    requests: int = 0
    bytes: int = 0
    seconds: float = 0.0
    failures: int = 0
    staging_seconds: float = 0.0  # copying the blocks between the device and host arrays (prefill: out)


def configure_engine(config: Any, scheduler: SchedulerConfig) -> Any:
    """The engine config a role runs with, or ConfigError at start-up for what it cannot do: a
    prefill instance runs synchronously (a request stops on its first token, which an
    asynchronous step would already have computed past); a speculative proposer with a model of
    its own keeps KV layers the transfer does not carry."""
    if scheduler.role == "mixed":
        return config
    from fd_core.engine.speculative.config import SpeculativeConfig

    spec = SpeculativeConfig.parse(config.speculative_config)  # the flag's JSON text, a dict or parsed
    if spec is not None and spec.method != "ngram":
        raise ConfigError(f"--role {scheduler.role}: speculative decoding with a model of its own ({spec.method}) "
                          f"is not carried across prefill/decode instances yet; use ngram, or a mixed instance")
    if scheduler.role == "prefill":
        if config.async_scheduling:
            raise ConfigError("--role prefill: --async-scheduling cannot be on: a prefill instance stops each request "
                              "on its first token")
        if config.num_scheduler_steps > 1:
            raise ConfigError("--role prefill: --num-scheduler-steps runs rounds of decode steps, and a prefill "
                              "instance decodes none (each request stops on its first token); leave it at 1")
        config = dataclasses.replace(config, async_scheduling=False)
    return config


def check_transfer(transfer: Any, core: Any, role: str) -> None:
    """ConfigError at start-up where ``core`` cannot hand ``transfer`` what it moves."""
    device = getattr(transfer, "device", "")
    if not device:
        if not core.capabilities.kv_swap:
            raise ConfigError(f"--role {role}: the {core.platform.name} backend cannot copy KV blocks to host "
                              f"memory (Capabilities.kv_swap), which the {transfer.name} KV-cache transfer stages "
                              f"through")
        return
    if device != core.platform.name:
        raise ConfigError(f"--role {role}: --cache-transfer-protocol {transfer.name} moves {device} device memory; "
                          f"this instance runs on {core.platform.name}")
    if core.tp.world_size > 1:
        raise ConfigError(f"--role {role}: --cache-transfer-protocol {transfer.name} moves one rank's device memory; "
                          f"with --tensor-parallel-size {core.tp.world_size} use a host connector (tcp, nixl)")


def kv_layout(core: Any) -> str:
    """What a decode instance's KV cache must match to take a prefill instance's blocks."""
    m, c = core.model_config, core.config
    return (f"{m.architecture}:{m.num_hidden_layers}x{m.num_key_value_heads}x{m.head_dim}:v{m.vocab_size}:"
            f"{c.cache_dtype}:b{c.block_size}:tp{core.tp.world_size}")


class PrefillSide(Role):
    """Hands each request the engine prefilled (``EngineCore.prefilled``) to a decode instance."""

    hand_over = True

    def __init__(self, scheduler: GlobalScheduler, transfer: Any, core: Any) -> None:
        self.scheduler = scheduler
        self.transfer = transfer
        self.layout = kv_layout(core)
        self.on_device = bool(getattr(transfer, "device", ""))  # the connector moves device tensors
        self.stats = TransferStats()
        # each request as its submitter queued it, until handed over: kept here rather than read
        # back from Redis's request hash, one round trip less per hand-over
        self._payloads: dict[str, bytes] = {}
        self._held = False  # the decode instances are backlogged: nothing new is pulled
        self._next_check = 0.0
        # request id -> (header, arrays, decode instances tried), until acknowledged
        self._sending: dict[str, tuple[Handover, list, list[str]]] = {}
        self._refused: list[TransferDone] = []  # sends the connector would not start
        self._encoder = msgspec.msgpack.Encoder()

    def pulled(self, request_id: str, payload: bytes) -> None:
        self._payloads[request_id] = payload

    def room(self, core: Any, room: int) -> int:
        now = time.monotonic()
        if room > 0 and now >= self._next_check:
            self._next_check = now + BACKLOG_CHECK_S
            backlogs = [(load.running + load.waiting) / max(1, load.capacity)
                        for load in self.scheduler.live().values()
                        if load.role == "decode" and load.kv_layout == self.layout]
            # with none at all, requests go on and end after their first token, saying so
            held = bool(backlogs) and min(backlogs) >= DECODE_BACKLOG
            if held and not self._held:
                log.warning("every decode instance of this layout has %.1f sequences per slot or more: no new "
                            "request is prefilled until one has fewer", DECODE_BACKLOG)
            elif self._held and not held:
                log.warning("a decode instance has room again: prefilling resumes")
            self._held = held
        return 0 if self._held else room

    def forget(self, request_id: str) -> None:
        self._payloads.pop(request_id, None)

    def poll(self, core: Any, inbox: Any) -> int:
        if core.prefilled():  # left over while Redis was away (an idle engine publishes nothing)
            self.stepped(core, inbox)
        self._completed(inbox.failures)
        return 0

    def stepped(self, core: Any, inbox: Any) -> None:
        if core.prefilled():
            # the first tokens go out before the requests are handed over, so that they reach
            # their requesters before anything the decode instance computes
            inbox.flush()
            self.send_prefilled(core, inbox.origins, inbox.failures)

    def close(self) -> None:
        self.transfer.close()

    def send_prefilled(self, core: Any, origins: dict[str, str], failures: dict[str, list[Failed]]) -> None:
        """Send on every prefilled request (its first token already published). Redis errors
        propagate: what was not handed over stays prefilled for the next call."""
        for seq in core.prefilled():
            request_id = seq.request_id
            origin = origins[request_id]
            header = Handover(request_id, origin, self._payloads[request_id], seq.output_token_ids[0], seq.seed,
                              max(0, seq.num_cached_tokens), self.layout, 0, self.scheduler.instance)
            try:
                target, load = self._choose([])
            except SchedulerUnavailableError as exc:
                core.release(seq)
                del origins[request_id], self._payloads[request_id]
                failures.setdefault(origin, []).append(Failed(
                    "SchedulerUnavailableError", f"the request was prefilled, but {exc} (its KV layout: "
                                                 f"{self.layout})", request_id))
                self.scheduler.finish([request_id])
                continue
            if not self.scheduler.hand_over(request_id, target):
                # reaped while it ran here (this instance looked dead): its requester was told
                core.release(seq)
                del origins[request_id], self._payloads[request_id]
                continue
            began = time.perf_counter()
            per_rank = core.export_kv(seq, self.on_device)
            self.stats.staging_seconds += time.perf_counter() - began
            header.ranks = len(per_rank)
            core.release(seq)
            del origins[request_id], self._payloads[request_id]
            self._send(header, [a for rank in per_rank for a in rank], [target], load)

    def _completed(self, failures: dict[str, list[Failed]]) -> None:
        """Account for the sends that ended; try a failed one once more elsewhere."""
        ended, self._refused = self.transfer.completed() + self._refused, []
        for done in ended:
            header, arrays, tried = self._sending.pop(done.request_id, (None, None, None))
            if header is None:
                continue
            if done.ok:
                self.stats.requests += 1
                self.stats.bytes += done.nbytes
                self.stats.seconds += done.seconds
                continue
            self.stats.failures += 1
            log.warning("the KV cache of %s did not reach %s: %s", done.request_id, tried[-1], done.error)
            target = None
            if len(tried) < TRIES:
                try:
                    target, load = self._choose(tried)
                except SchedulerUnavailableError:
                    target = None
            if target is not None and self.scheduler.hand_over(done.request_id, target, owner=tried[-1]):
                self._send(header, arrays, [*tried, target], load)
                continue
            if not self.scheduler.end(done.request_id, tried[-1]):
                continue  # the decode instance was reaped with it: its requester was told
            failures.setdefault(header.origin, []).append(Failed(
                "SchedulerUnavailableError", f"the request's KV cache could not be sent to a decode instance "
                                             f"({', '.join(tried)}): {done.error}", done.request_id))

    def _choose(self, tried: list[str]) -> tuple[str, Load]:
        def fits(instance: str, load: Load) -> bool:
            return load.kv_layout == self.layout and bool(load.kv_endpoint) and instance not in tried

        return self.scheduler.pick("decode", fits)

    def _send(self, header: Handover, arrays: list, tried: list[str], load: Load) -> None:
        self._sending[header.request_id] = (header, arrays, tried)
        try:
            self.transfer.send(load.kv_endpoint, header.request_id, self._encoder.encode(header), arrays)
        except KVTransferError as exc:  # e.g. an endpoint of another connector: a failed send
            self._refused.append(TransferDone(header.request_id, 0, 0.0, str(exc)))


class DecodeSide(Role):
    """Admits the requests prefill instances hand over."""

    takes_queue = False

    def __init__(self, scheduler: GlobalScheduler, transfer: Any, core: Any, config: SchedulerConfig) -> None:
        self.scheduler = scheduler
        self.transfer = transfer
        self.layout = kv_layout(core)
        self.endpoint = transfer.listen(config.pd_comm_host, config.pd_comm_port)
        self.stats = TransferStats()
        self._aborted: dict[str, float] = {}  # aborts that came before their request
        self._decoder = msgspec.msgpack.Decoder(Handover)
        self._request = msgspec.msgpack.Decoder(AddRequest)
        log.info("decode instance: receiving KV caches (%s) at %s", transfer.name, self.endpoint)

    def abort(self, core: Any, request_id: str, index: int | None) -> None:
        if request_id in core.seqs:
            core.abort(request_id, index)
        elif index is None:
            self._aborted[request_id] = time.monotonic()

    def report(self, load: Load) -> None:
        load.kv_endpoint, load.kv_layout = self.endpoint, self.layout

    def close(self) -> None:
        self.transfer.close()

    def poll(self, core: Any, inbox: Any) -> int:
        return self.admit(core, inbox.origins, inbox.failures, inbox.finished)

    def admit(self, core: Any, origins: dict[str, str], failures: dict[str, list[Failed]],
              finished: list[str]) -> int:
        """Queue the requests that arrived; how many."""
        now = time.monotonic()
        self._aborted = {r: t for r, t in self._aborted.items() if now - t < ABORT_MEMORY_S}
        arrived = self.transfer.received()
        for item in arrived:
            self.stats.requests += 1
            self.stats.bytes += item.nbytes
            try:
                header = self._decoder.decode(item.header)
            except msgspec.DecodeError as exc:
                log.error("dropped a KV transfer for %s with a malformed header: %s", item.request_id, exc)
                continue
            if self._aborted.pop(header.request_id, None) is not None:
                finished.append(header.request_id)
                continue
            try:
                if header.layout != self.layout:
                    raise ConfigError(f"the prefill instance {header.prefill} sent a KV cache of layout "
                                      f"{header.layout}; this decode instance holds {self.layout}")
                msg = self._request.decode(header.payload)
                per = len(item.arrays) // max(1, header.ranks)
                kv = [item.arrays[r * per : (r + 1) * per] for r in range(header.ranks)]
                core.add_request(header.request_id, msg.token_ids, params_from_wire(msg.params), msg.cache_salt,
                                 prefilled=Prefilled(header.first_token, header.seed, kv, header.num_cached_tokens))
            except Exception as exc:  # noqa: BLE001 - this request only; the others go on
                failures.setdefault(header.origin, []).append(Failed(type(exc).__name__, str(exc), header.request_id))
                finished.append(header.request_id)
                continue
            origins[header.request_id] = header.origin
        return len(arrived)

"""Every Redis key and stream name pagedserve uses, in one place (all under one prefix)."""
from __future__ import annotations

from dataclasses import dataclass

FIELD = "m"  # each stream entry holds one msgpack payload under this field
READER_SEPARATOR = ":"  # a reader key's token: the gateway instance, then the connection's nonce
# Approximate caps of the shared streams (requests is never trimmed: entries leave when acknowledged).
CONTROL_MAXLEN = 10_000
RESULTS_MAXLEN = 10_000
PLANS_MAXLEN = 1_000


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str = "ps"

    @property
    def requests(self) -> str:
        """Stream of Request; read by the schedulers' consumer group."""
        return f"{self.prefix}:requests"

    @property
    def scheduler_group(self) -> str:
        return f"{self.prefix}:schedulers"

    @property
    def control(self) -> str:
        """Stream of Abort and WorkerGone."""
        return f"{self.prefix}:control"

    @property
    def results(self) -> str:
        """Stream of StepResult from every worker."""
        return f"{self.prefix}:results"

    @property
    def workers(self) -> str:
        """Hash worker id → encoded WorkerRegistration."""
        return f"{self.prefix}:workers"

    @property
    def epoch(self) -> str:
        """Counter bumped by each scheduler start; plans carry it."""
        return f"{self.prefix}:epoch"

    @property
    def scheduler_lease(self) -> str:
        return f"{self.prefix}:scheduler:lease"

    @property
    def stats(self) -> str:
        """String key holding the encoded SchedulerStats the gateway's /metrics reads."""
        return f"{self.prefix}:stats"

    @property
    def cache_snapshot(self) -> str:
        """String key holding the encoded CacheSnapshot that /dashboard shows (with a short TTL)."""
        return f"{self.prefix}:cache_snapshot"

    @property
    def dashboard_watch(self) -> str:
        """Key a gateway keeps alive (with a TTL) while a dashboard polls it: the scheduler publishes cache
        snapshots only then."""
        return f"{self.prefix}:dashboard:watch"

    def plans(self, worker_id: str) -> str:
        return f"{self.prefix}:plans:{worker_id}"

    def heartbeat(self, worker_id: str) -> str:
        return f"{self.prefix}:heartbeat:{worker_id}"

    def gateway_alive(self, instance: str) -> str:
        """Heartbeat key of one gateway instance (with a TTL): once it is gone, so are its requests' clients."""
        return f"{self.prefix}:gateway:{instance}:alive"

    def gateway_wake(self, instance: str) -> str:
        """Stream a gateway writes with each submission, so that its pending read of the token streams
        returns and takes in the new requests' streams."""
        return f"{self.prefix}:gateway:{instance}:wake"

    def reader(self, rid: str) -> str:
        """The token of the gateway connection that streams a request to its client now (`instance:nonce`): a gateway
        whose client went away aborts the request after the grace period only if no other connection took it up."""
        return f"{self.prefix}:reader:{rid}"

    def call(self, call_id: str) -> str:
        """Hash holding a streamed API call's record (its route, body and owner), so that any gateway can pick its
        stream up again."""
        return f"{self.prefix}:call:{call_id}"

    def response(self, response_id: str) -> str:
        """Hash holding a stored response of the Responses API."""
        return f"{self.prefix}:response:{response_id}"

    @property
    def responses(self) -> str:
        """Sorted set of stored response ids by creation time: the store's bound evicts the oldest."""
        return f"{self.prefix}:responses"

    @staticmethod
    def reader_token(instance: str, connection: str) -> str:
        return f"{instance}{READER_SEPARATOR}{connection}"

    @staticmethod
    def reader_instance(token: bytes | str) -> str:
        """The gateway instance a reader key's token names."""
        text = token.decode() if isinstance(token, bytes) else token
        return text.partition(READER_SEPARATOR)[0]

    def out(self, rid: str) -> str:
        """Stream of TokenOutput for one request."""
        return f"{self.prefix}:out:{rid}"

"""What a client is shown rests on a replica too: Redis replicates asynchronously, so a failover loses the writes the
old master had not passed on, and a token a client saw must not be among them (issue 39).

After a read whose replies a client will be shown, the gateway asks the master, on the same connection, for its
replicas (ROLE); if it has any, it writes a key of its own (a write Redis always passes on) and `WAIT`s until
`replica_acks` of them (at most as many as it has) hold it: as a replica applies the master's writes in order, they
then hold everything the read returned. One connection carries it all, so it all meets one master; a failover in
between breaks the connection, and the read is made again on the new master. Writes a client is told of (a request
queued, a response deleted) are waited for the same way, and made again if the master moved meanwhile (each is
idempotent). The scheduler resumes requests from what the new master holds (scheduler/service.py), so a client's
stream goes on from the last token it saw, sampled or not.

With no replica (a single Redis) nothing waits; the read costs one ROLE more. Past `replica_ack_timeout` the gateway
goes on without the replicas (availability over durability), logs it once per spell and counts it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ReplicaGate:
    wanted: int  # settings.replica_acks
    timeout_ms: int
    replicas: int = -1  # replicas the master had at the last ROLE (-1: not asked yet)
    shortfalls: int = 0  # waits that ended with fewer replicas than asked
    short: bool = False  # the last wait fell short: the next shortfall is not logged again

    def required(self, role: list) -> int:
        """From a ROLE reply of the master: how many replicas to wait for."""
        replicas = len(role[2]) if len(role) > 2 and isinstance(role[2], list) else 0
        if replicas != self.replicas:
            log.info("the Redis master has %d replica(s); clients are shown what %d hold", replicas,
                     min(self.wanted, replicas))
            self.replicas = replicas
        return min(self.wanted, replicas)

    def waited(self, acks: int, required: int) -> None:
        """Take a WAIT's reply."""
        if acks >= required:
            self.short = False
            return
        self.shortfalls += 1
        if not self.short:
            log.warning("only %d of %d Redis replicas acknowledged within %d ms; going on without them (a failover "
                        "now could lose what clients are shown)", acks, required, self.timeout_ms)
        self.short = True

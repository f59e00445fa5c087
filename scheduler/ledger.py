"""The tenants' ledger (sans-IO), one for the whole cluster: what each tenant has waiting, running and computed,
against the limits its terms set (shared/tenants.py) and the server's own; and, for the fair policy, its virtual
token counter.

Fair shares follow "Fairness in Serving Large Language Models" (Sheng et al., OSDI 2024): each tenant's counter
grows by the tokens computed for it (a generated token counting twice a prompt token, the paper's weights) over its
weight, admission takes the tenant with the least, and a tenant that had nothing in the queue starts again at the
least counter of those that had, so that being idle earns no credit to burst with later. The worker schedulers
charge it as they plan; the cluster tells it when requests arrive, start and end, and the time at each tick.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Callable

from shared.drain import Drain
from shared.protocol import Request
from shared.settings import Settings
from shared.tenants import Tenant, under_share

PREFILL_COST = 1.0
DECODE_COST = 2.0
TOKENS_WINDOW_S = 60.0  # tokens_per_minute's


@dataclass(slots=True)
class Account:
    tenant: Tenant  # its terms, as its latest request carried them
    counter: float = 0.0  # virtual tokens: cost of the tokens computed for it / weight
    live: int = 0  # requests here that have not ended
    waiting: int = 0  # of those, never admitted yet
    queued_tokens: int = 0  # their prompt tokens
    running_seqs: int = 0  # sequences running on any worker
    computed: int = 0  # tokens computed since the last tick
    recent: deque[tuple[float, int]] = field(default_factory=deque)  # (tick time, tokens computed before it)
    drain: Drain = field(default_factory=Drain)  # its requests leaving the queue
    admitted_since_tick: int = 0

    def tokens_in_window(self) -> int:
        return sum(tokens for _, tokens in self.recent)


WAITING = attrgetter("waiting")  # what the server's limits count, per account
QUEUED_TOKENS = attrgetter("queued_tokens")


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request is turned away at arrival, and how long its client should wait."""
    message: str
    retry_after: float


class Ledger:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.accounts: dict[str, Account] = {}
        self.drain = Drain()  # every tenant's requests leaving the queue
        self.now = 0.0  # the last tick's time
        self.seats = 0  # sequences all the workers run at once at most: what the fair policy's shares split

    def account(self, tenant: Tenant) -> Account:
        account = self.accounts.get(tenant.name)
        if account is None:
            account = self.accounts[tenant.name] = Account(tenant)
        return account

    # ---- arrival --------------------------------------------------------------------------
    def refusal(self, req: Request) -> Refusal | None:
        """Why the request may not join the queue (its tenant's limits, then the server's), or None."""
        tenant = req.tenant
        account = self.account(tenant)
        account.tenant = tenant  # the keys file as the gateway read it last
        prompt = len(req.prompt_token_ids)
        name = f"tenant {tenant.name}"
        if tenant.max_waiting_requests and account.waiting >= tenant.max_waiting_requests:
            return self._full(f"{name} has {account.waiting} requests waiting, its limit", account.drain, 1)
        if tenant.max_queued_tokens and account.queued_tokens + prompt > tenant.max_queued_tokens:
            return self._full(f"{name} has {account.queued_tokens} prompt tokens waiting; this request's {prompt} "
                              f"would pass its limit of {tenant.max_queued_tokens}", account.drain, 1)
        if tenant.tokens_per_minute and account.tokens_in_window() >= tenant.tokens_per_minute:
            return Refusal(f"{name} had {account.tokens_in_window()} tokens computed in the last minute, its limit "
                           f"is {tenant.tokens_per_minute} per minute", self._window_frees(account))
        waiting = sum(a.waiting for a in self.accounts.values())
        limit = self.settings.max_waiting_requests
        if waiting >= limit and not self._under_share(account, limit, WAITING, waiting, 1):
            return self._full(f"{waiting} requests are waiting, the server's limit", self.drain, 1)
        queued = sum(a.queued_tokens for a in self.accounts.values())
        limit = self.settings.max_queued_tokens
        if limit and queued + prompt > limit and not self._under_share(account, limit, QUEUED_TOKENS, queued, prompt):
            return self._full(f"{queued} prompt tokens are waiting; this request's {prompt} would pass the server's "
                              f"limit of {limit}", self.drain, 1)
        return None

    def _under_share(self, account: Account, limit: int, held: Callable[[Account], int], total: int,
                     adding: int) -> bool:
        """Under the fair policy, whether the tenant stays within its share of the server's limit on what `held`
        counts (`total` in all) when it adds `adding`."""
        if self.settings.scheduling_policy != "fair":
            return False
        weights = sum(a.tenant.weight for a in self.accounts.values() if held(a) or a is account)
        return under_share(limit, total, held(account), adding, account.tenant.weight, weights)

    def _full(self, message: str, drain: Drain, excess: int) -> Refusal:
        return Refusal(message, drain.retry_after(excess, self.now))

    def _window_frees(self, account: Account) -> float:
        """Seconds until enough of the tenant's last minute of tokens leaves its window."""
        over, limit = account.tokens_in_window(), account.tenant.tokens_per_minute
        for when, tokens in account.recent:
            over -= tokens
            if over < limit:
                return max(when + TOKENS_WINDOW_S - self.now, 0.5)
        return TOKENS_WINDOW_S

    def arrived(self, req: Request) -> None:
        """The request joined the queue. A tenant with nothing here starts at the least counter of those with work:
        it never comes back with credit saved up while it was idle."""
        account = self.account(req.tenant)
        if not account.live:
            busy = [a.counter for a in self.accounts.values() if a.live]
            if busy:
                account.counter = max(account.counter, min(busy))
        account.live += 1
        account.waiting += 1
        account.queued_tokens += len(req.prompt_token_ids)

    # ---- what the worker schedulers tell ---------------------------------------------------
    def admitted(self, req: Request) -> None:
        """The request left the queue for its first step."""
        account = self.accounts[req.tenant.name]
        account.waiting -= 1
        account.queued_tokens -= len(req.prompt_token_ids)
        account.admitted_since_tick += 1

    def seated(self, tenant: str, num_seqs: int) -> None:
        self.accounts[tenant].running_seqs += num_seqs

    def may_seat(self, tenant: Tenant, num_seqs: int) -> bool:
        """Whether the tenant may start `num_seqs` more sequences (max_seqs, counted across all workers)."""
        limit = tenant.max_seqs
        return not limit or self.accounts[tenant.name].running_seqs + num_seqs <= limit

    def seat_use(self, tenant: str, adding: int = 0) -> float:
        """The tenant's running sequences on all the workers (and `adding` more) over its weight."""
        account = self.accounts[tenant]
        return (account.running_seqs + adding) / account.tenant.weight

    def seat_share(self) -> float:
        """A unit of weight's share of the seats: split among the tenants with requests here."""
        return self.seats / max(sum(a.tenant.weight for a in self.accounts.values() if a.live), 1e-9)

    def charge(self, tenant: str, prefill: int, decode: int) -> None:
        """Tokens a plan computes for the tenant, at its weight as the latest request to join the queue carried it (as
        its shares are weighed: seat_use)."""
        account = self.accounts[tenant]
        account.computed += prefill + decode
        account.counter += (PREFILL_COST * prefill + DECODE_COST * decode) / account.tenant.weight

    def counter(self, tenant: str) -> float:
        return self.accounts[tenant].counter

    def ended(self, req: Request, queued: bool) -> None:
        """The request ended (`queued`: before it was ever admitted)."""
        account = self.accounts[req.tenant.name]
        account.live -= 1
        if queued:
            account.waiting -= 1
            account.queued_tokens -= len(req.prompt_token_ids)

    # ---- time -----------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Stamp what happened since the last tick with `now`; forget what left the windows."""
        self.now = now
        for account in self.accounts.values():
            if account.computed:
                account.recent.append((now, account.computed))
                account.computed = 0
            while account.recent and account.recent[0][0] <= now - TOKENS_WINDOW_S:
                account.recent.popleft()
            for _ in range(account.admitted_since_tick):
                account.drain.left(now)
                self.drain.left(now)
            account.admitted_since_tick = 0

    def queue_time_limit(self, tenant: Tenant) -> float:
        """Seconds a request of the tenant may wait for admission (0: no limit): the tighter of the two."""
        limits = [t for t in (tenant.max_queue_time, self.settings.max_queue_time) if t]
        return min(limits, default=0.0)

    def retry_after(self, tenant: Tenant) -> float:
        return self.accounts[tenant.name].drain.retry_after(1, self.now)

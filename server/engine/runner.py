"""The model runner: one request at a time, prefix reuse on every cache family.

```
 messages -> PromptBuilder -> ids, image spans
   -> root hash (format, model fingerprint, tenant salt) -> lookup -> plan_restore -> live caches
   -> vision features only for images not fully inside the restored prefix (feature cache first)
   -> suffix embeddings -> chunked prefill (harvest after each chunk, checkpoint at chunk ends,
      stop at the last block boundary for an exact end-of-prompt snapshot)
   -> decode (harvest every min(B, window) tokens) -> end-of-generation snapshot
```
Everything here runs on the engine thread.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import mlx.core as mx

from kv_cache.families import family_for, family_registry
from kv_cache.hashing import CACHE_FORMAT_VERSION, root_hash
from kv_cache.prefix_cache import PrefixCache
from kv_cache.tiered import TieredPrefixCache
from kv_cache.tiers.ram import RamTier
from kv_cache.tiers.ssd import SsdTier
from server.engine.accounting import RequestTrace, TenantCounters, with_ratios
from server.engine.architectures import Positions, architecture_for
from server.engine.detokenizer import StreamingDetokenizer
from server.engine.harvest import Harvester
from server.engine.lifecycle import CacheLifecycle, ErasureReport, SweepReport
from server.engine.metrics_snapshot import (
    EngineSnapshot,
    snapshot_of,
    ssd_served_tokens,
    ssd_tier_snapshot,
)
from server.engine.miss_tracking import MissTracker
from server.engine.model import LoadedModel, load_model
from server.engine.features import FeatureProvider
from server.engine.prompt import BuiltPrompt, PromptBuilder, PromptError, PromptImage, ReplyLedger
from server.engine.restore import plan_restore, restore_caches
from server.engine.sampling import Sampler
from server.engine.settings import EngineSettings
from server.engine.types import (
    EngineError,
    EngineEvent,
    FinishEvent,
    GenerationRequest,
    TokenEvent,
    Usage,
)
from tenancy.tenants import Tenant
from vision_cache.encoders import encoder_for
from vision_cache.feature_cache import FeatureCache
from vision_cache.ssd import FeatureCodec, FeatureSsd

log = logging.getLogger(__name__)


class ModelRunner:
    """Implements ``server.engine.protocol.Engine`` for one loaded mlx-vlm model.

    Args:
        loaded: The model.
        settings: Engine settings.
        ledger: The reply ledger (tests share one between runners).
        clock: Wall-clock seconds of retention: ``stored_at`` stamps and expiry cutoffs
            (injectable for tests).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        settings: EngineSettings,
        *,
        ledger: ReplyLedger | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._m = loaded
        self._settings = settings
        self._B = settings.block_size
        self._chunk = max(self._B, settings.prefill_chunk // self._B * self._B)
        model = loaded.model
        self._lm = model.language_model
        self._arch = architecture_for(loaded.model_type, model, loaded.tokenizer)
        self._encoder = encoder_for(loaded.model_type, model, loaded.processor)
        self._ledger = ledger if ledger is not None else ReplyLedger(clock=clock)
        self._prompts = PromptBuilder(loaded.tokenizer, self._arch, self._encoder, self._ledger)
        self._registry = family_registry()
        self._families = tuple(family_for(c, self._registry) for c in self._new_caches())
        windows = [f.window(c) for f, c in zip(self._families, self._new_caches())]
        sliding = [w for w in windows if w]
        # Decode must copy K/V out before it leaves the smallest sliding window.
        self._decode_interval = min([self._B, *sliding])
        self._recurrent = any(f.needs_checkpoint for f in self._families)
        self.ram = RamTier(settings.ram_budget_bytes)
        self.ssd: SsdTier | None = None
        if settings.ssd_enabled:
            self.ssd = SsdTier(
                settings.cache_dir,
                loaded.fingerprint,
                [f.name for f in self._families],
                budget_bytes=settings.ssd_budget_bytes,
                queue_size=settings.ssd_queue_size,
                codecs=(FeatureCodec(loaded.fingerprint),),
            )
        # Blocks leaving RAM (evicted or refused) go to SSD.
        self.prefix_cache = PrefixCache(
            self._B, self.ram, on_evict=self.ssd.spill if self.ssd is not None else None, clock=clock
        )
        self.misses = MissTracker(self._B, threshold=settings.hit_rate_warn_threshold,
                                  window=settings.hit_rate_window)
        self.tiered = TieredPrefixCache(self.prefix_cache, self.ssd, needs_checkpoint=self._recurrent,
                                        on_expired=self.misses.record_expired)
        self.prefix_cache.watch_evictions(self.misses.record_evicted)
        vision_budget = settings.vision_budget_bytes or max(self.ram.budget_bytes // 8, 16 << 20)
        # Features count toward their tenant's RAM quota (the vision budget stays separate).
        self.features = FeatureCache(vision_budget, clock=clock, ram=self.ram)
        self.feature_ssd = FeatureSsd(self.ssd, loaded.fingerprint) if self.ssd is not None else None
        self.vision = FeatureProvider(
            encoder=self._encoder, fingerprint=loaded.fingerprint, ram=self.features,
            ssd=self.feature_ssd, clock=clock,
        )
        self.lifecycle = CacheLifecycle(
            ram=self.ram, prefix_cache=self.prefix_cache, ssd=self.ssd, features=self.features,
            feature_ssd=self.feature_ssd, ledger=self._ledger, clock=clock,
            on_expired=self.misses.record_expired,
        )
        self._counters: dict[str, TenantCounters] = {}
        self.last_trace = RequestTrace()
        self._closed = False

    # -- Engine protocol -------------------------------------------------------------------

    @property
    def model_id(self) -> str:
        return self._m.model_id

    @property
    def context_length(self) -> int:
        return self._m.context_length

    @property
    def fingerprint(self) -> str:
        return self._m.fingerprint

    @property
    def ledger(self) -> ReplyLedger:
        return self._ledger

    @property
    def prompt_builder(self) -> PromptBuilder:
        return self._prompts

    def generate(
        self,
        request: GenerationRequest,
        emit: Callable[[EngineEvent], None],
        cancelled: Callable[[], bool],
    ) -> None:
        try:
            self._generate(request, emit, cancelled)
        except PromptError as exc:
            emit(EngineError(400, str(exc), "invalid_request_error", "invalid_prompt", "messages"))
        except _ContextLengthError as exc:
            emit(EngineError(400, str(exc), "invalid_request_error", "context_length_exceeded", "messages"))
        except Exception as exc:
            log.exception("request %s failed", request.request_id)
            emit(EngineError(500, f"internal error: {type(exc).__name__}: {exc}"))

    def cache_stats(self, tenant: Tenant | None) -> Mapping[str, Any]:
        if tenant is not None:
            counters = self._counters.get(tenant.namespace, TenantCounters())
            return {"tenant": tenant.tenant_id, **with_ratios(counters.as_dict()),
                    **self.misses.stats(tenant.namespace), "usage": self._usage(tenant)}
        total = TenantCounters()
        for c in list(self._counters.values()):
            for name in total.__slots__:
                setattr(total, name, getattr(total, name) + getattr(c, name))
        return {
            **with_ratios(total.as_dict()),
            "tenants": len(self._counters),
            "kv": {**dataclasses.asdict(self.prefix_cache.stats), "blocks": len(self.prefix_cache),
                   "resident_bytes": self.prefix_cache.resident_bytes},
            "ram": {"budget_bytes": self.ram.budget_bytes, "used_bytes": self.ram.used_bytes},
            "vision": dataclasses.asdict(self.features.stats()),
            "ssd": self._ssd_stats(),
            **self.misses.stats(None),
        }

    def metrics_snapshot(self) -> EngineSnapshot:
        """Counters for the Prometheus collector; safe from any thread, no MLX work."""
        return snapshot_of(
            counters=list(self._counters.values()),
            prefix_cache=self.prefix_cache,
            ram=self.ram,
            features=self.features,
            misses=self.misses,
            lower_tiers=self._lower_tier_snapshots(),
        )

    def _lower_tier_snapshots(self) -> tuple[Any, ...]:
        if self.ssd is None:
            return ()
        vision_hits = self.feature_ssd.stats.hits if self.feature_ssd is not None else 0
        return (ssd_tier_snapshot(self.ssd.stats(), promotions=self.tiered.stats.promotions + vision_hits),)

    def _ssd_stats(self) -> dict[str, Any]:
        if self.ssd is None or self.feature_ssd is None:
            return {"enabled": False}
        return {
            "enabled": True,
            **dataclasses.asdict(self.ssd.stats()),
            **dataclasses.asdict(self.tiered.stats),
            "vision": dataclasses.asdict(self.feature_ssd.stats),
        }

    def _usage(self, tenant: Tenant) -> dict[str, Any]:
        """What a tenant holds now, against its quotas."""
        ns = tenant.namespace
        return {
            "ram_bytes": self.ram.usage_of(ns),
            "ram_quota_bytes": self.ram.quota(ns),
            "kv_blocks": sum(1 for b in self.prefix_cache.pool if b.namespace == ns),
            "vision_features": self.features.stats(ns).entries,
            "ssd_bytes": self.ssd.usage().get(ns, 0) if self.ssd is not None else 0,
            "ssd_quota_bytes": tenant.settings.ssd_quota_bytes,
            "retention_seconds": tenant.settings.retention_seconds,
        }

    # -- tenancy lifecycle (engine thread) ---------------------------------------------------

    def configure_tenants(self, tenants: Sequence[Tenant]) -> None:
        """Apply every tenant's quotas and retention (the registry, at startup)."""
        self.lifecycle.configure(tenants)

    def erase_session(self, tenant: Tenant, session_id: str) -> ErasureReport:
        """Erase the state only ``session_id`` of ``tenant`` owns, in every tier."""
        return self.lifecycle.erase_session(tenant, session_id)

    def erase_tenant(self, tenant: Tenant) -> ErasureReport:
        """Erase all state of ``tenant``, in every tier."""
        self.misses.forget_namespace(tenant.namespace)
        return self.lifecycle.erase_tenant(tenant)

    def sweep(self) -> SweepReport:
        """Drop state past its tenant's retention, in every tier."""
        return self.lifecycle.sweep()

    def close(self) -> None:
        """Drop expired state, write resident KV blocks and queued records to SSD, then release
        the SSD tier (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.lifecycle.sweep()
        self.tiered.close()

    # -- the request path ------------------------------------------------------------------

    def _new_caches(self) -> list[Any]:
        lm = self._lm
        if hasattr(lm, "make_cache"):
            return list(lm.make_cache())
        from mlx_vlm.models.cache import KVCache

        return [KVCache() for _ in lm.layers]

    def _generate(
        self,
        request: GenerationRequest,
        emit: Callable[[EngineEvent], None],
        cancelled: Callable[[], bool],
    ) -> None:
        t0 = time.perf_counter()
        tenant = request.tenant
        self.lifecycle.observe(tenant)
        counters = self._counters.setdefault(tenant.namespace, TenantCounters())
        trace = RequestTrace()
        self.last_trace = trace
        prompt = self._prompts.build(
            request.messages, tenant.namespace, expired_before=self.lifecycle.cutoff(tenant.namespace)
        )
        n = len(prompt)
        if n >= self.context_length:
            raise _ContextLengthError(
                f"prompt is {n} tokens; this model's context is {self.context_length} tokens"
            )
        max_tokens = min(request.sampling.max_tokens, self.context_length - n)
        sampler = Sampler(request.sampling)
        ids = prompt.token_ids
        trace.prompt_ids = ids
        trace.prompt_tokens = n

        root = root_hash(CACHE_FORMAT_VERSION, self._m.fingerprint, tenant.salt)
        promotions_before = self.tiered.stats.promotions
        hit = self.tiered.lookup(root, ids, prompt.spans, tenant.namespace,
                                 expired_before=self.lifecycle.cutoff(tenant.namespace))
        self.misses.observe(root=root, prompt=prompt, matched_blocks=len(hit.blocks),
                            stored=self.prefix_cache.pool, namespace=tenant.namespace)
        plan = plan_restore(
            hit, root, self._B, self._families, n - 1,
            children_of=self.prefix_cache.pool.children_of, tokens=ids, spans=prompt.spans,
        )
        used = plan.used_blocks
        self.prefix_cache.acquire(used)
        try:
            self.prefix_cache.touch(used)
            if request.session_id is not None:
                # A session that reuses blocks depends on them: it owns them too (erasure of
                # another session must not take them away).
                for block in plan.blocks:
                    self.prefix_cache.pool.add_owner(block, request.session_id)
            if plan.length > 0:
                caches, seed = restore_caches(plan, self._new_caches(), self._families)
            else:
                caches, seed = self._new_caches(), None
            L = plan.length
            trace.cached_tokens = L
            self._reset_module_state()
            positions = self._arch.positions(ids, [img.layout for img in prompt.images])
            embeds = self._suffix_embeddings(prompt, L, request, counters, trace)

            harvester = Harvester(
                store=self.tiered.store_for(tenant.namespace),
                families=self._families,
                block_size=self._B,
                spans=prompt.spans,
                owner=request.session_id,
                parent=plan.parent,
                block_start=L // self._B * self._B,
                seed_pieces=seed,
                fed=L,
            )
            tokens: list[int] = [int(t) for t in ids]
            logits = self._prefill(prompt, embeds, L, caches, positions, harvester, tokens)
        finally:
            self.prefix_cache.release(used)

        counters.requests += 1
        counters.prompt_tokens += n
        counters.cached_tokens += L
        counters.cached_tokens_ssd += ssd_served_tokens(
            [b.num_tokens for b in plan.blocks] + ([plan.tail_tokens] if plan.tail is not None else []),
            self.tiered.stats.promotions - promotions_before, L)
        self._decode(
            request, emit, cancelled, sampler, logits, caches, positions, harvester, tokens,
            n, max_tokens, trace, counters, t0,
        )

    def _reset_module_state(self) -> None:
        # Qwen language models keep rope state between calls; every request starts clean.
        for name in ("_rope_deltas", "_position_ids"):
            if hasattr(self._lm, name):
                setattr(self._lm, name, None)

    def _suffix_embeddings(
        self,
        prompt: BuiltPrompt,
        start: int,
        request: GenerationRequest,
        counters: TenantCounters,
        trace: RequestTrace,
    ) -> mx.array:
        """Input embeddings of positions [start, n): token embeddings, image features spliced."""
        ids = prompt.token_ids
        n = len(prompt)
        embed = self._lm.model.embed_tokens
        pieces: list[mx.array] = []
        pos = start
        for img in prompt.images:
            span = img.span
            if span.end <= start:
                continue  # fully inside the restored prefix: costs only its hash
            feats = self._features_for(img, request, counters, trace)
            a = max(span.start, start)
            if a > pos:
                pieces.append(embed(mx.array(ids[pos:a])))
            pieces.append(feats[a - span.start :].astype(embed.weight.dtype))
            pos = span.end
        if pos < n:
            pieces.append(embed(mx.array(ids[pos:n])))
        return mx.concatenate(pieces, axis=0) if len(pieces) > 1 else pieces[0]

    def _features_for(
        self, img: PromptImage, request: GenerationRequest, counters: TenantCounters, trace: RequestTrace
    ) -> mx.array:
        ns = request.tenant.namespace
        counters.vision_queries += 1
        result = self.vision.features_for(img, ns, request.session_id, self.lifecycle.cutoff(ns))
        if result.hit:
            counters.vision_hits += 1
            trace.vision_hits += 1
        else:
            counters.encoder_runs += 1
            trace.encoder_runs += 1
        return result.features

    def _lm_call(self, token_ids: mx.array, embeds: mx.array | None, caches: list[Any], position_ids: mx.array | None) -> mx.array:
        kwargs: dict[str, Any] = {"cache": caches}
        if embeds is not None:
            kwargs["inputs_embeds"] = embeds[None]
        if position_ids is not None:
            kwargs["position_ids"] = position_ids
        out = self._lm(token_ids[None], **kwargs)
        return out.logits if hasattr(out, "logits") else out

    def _prefill(
        self,
        prompt: BuiltPrompt,
        embeds: mx.array,
        start: int,
        caches: list[Any],
        positions: Positions | None,
        harvester: Harvester,
        tokens: list[int],
    ) -> mx.array:
        """Prefill [start, n) in chunks; returns the logits of the last prompt position.

        Stops (each a forward call boundary) fall on multiples of the chunk size (recurrent
        checkpoints land on boundaries other prompts share) and on the end-of-prompt snapshot
        point: ``n`` for attention-only models (they trim, so the snapshot also serves an
        identical prompt at ``n - 1``), ``n - 1`` for recurrent ones (a checkpoint at ``n``
        could never serve the same prompt again: one token must be left). No stop is needed at
        the last block boundary: K/V are harvested per position, and the recurrent snapshot at
        ``n - 1`` is the better restore point.

        Recurrent models also get restore points where prompts sharing a history tend to part
        (attention models reach any such length by trimming; recurrent state only where a
        checkpoint was taken).
        """
        ids = prompt.token_ids
        n = int(ids.shape[0])
        snapshot = n - 1 if self._recurrent else n
        restore_points = {snapshot}
        if self._recurrent:
            # Each point splits the forward pass and costs a state copy, so only where reuse
            # is likely: the end of the opening message (a shared system prompt), the start of
            # the last message (a retried or edited question) and image ends.
            restore_points.update(prompt.text_starts[1:2] + prompt.text_starts[-1:])
            restore_points.update(img.span.end for img in prompt.images)
        # A point a few tokens past the restored length, or a few tokens before another point
        # (an image end just before the next text), would cost a whole forward call for almost
        # no reuse: keep the later of close points. The snapshot point is always kept.
        gap = max(1, self._B // 4)
        kept = {snapshot}
        later = snapshot
        for p in sorted((p for p in restore_points if start < p < snapshot), reverse=True):
            if later - p >= gap and p - start >= gap:
                kept.add(p)
                later = p
        restore_points = kept
        stops = {n, *restore_points}
        stops.update(range((start // self._chunk + 1) * self._chunk, n, self._chunk))
        pos = start
        logits = None
        for end in sorted(p for p in stops if p > start):
            chunk_ids = mx.array(ids[pos:end])
            chunk_pos = positions.position_ids[..., pos:end] if positions is not None else None
            logits = self._lm_call(chunk_ids, embeds[pos - start : end - start], caches, chunk_pos)
            mx.eval(logits[:, -1, :], [c.state for c in caches])
            pos = end
            harvester.collect(caches, pos)
            if pos % self._chunk == 0 or pos in restore_points:
                harvester.checkpoint(caches, pos)
            harvester.flush_full(tokens)
            if pos in restore_points:
                harvester.flush_partial(tokens)
        assert logits is not None
        return logits[0, -1, :]

    def _decode(
        self,
        request: GenerationRequest,
        emit: Callable[[EngineEvent], None],
        cancelled: Callable[[], bool],
        sampler: Sampler,
        logits: mx.array,
        caches: list[Any],
        positions: Positions | None,
        harvester: Harvester,
        tokens: list[int],
        n: int,
        max_tokens: int,
        trace: RequestTrace,
        counters: TenantCounters,
        t0: float,
    ) -> None:
        detok = StreamingDetokenizer(self._m.tokenizer, self._m.eos_ids)
        generated: list[int] = trace.generated
        fed = n
        finish = "length"
        y = sampler(logits)
        while True:
            tok = int(y.item())
            if not generated:
                trace.ttft_s = time.perf_counter() - t0
            generated.append(tok)
            if tok in self._m.eos_ids:
                finish = "stop"
                break
            emit(TokenEvent(detok.add(tok), tok))
            if len(generated) >= max_tokens:
                break
            if cancelled():
                finish = "cancelled"
                break
            step_pos = self._arch.decode_positions(positions, fed, 1)
            out = self._lm_call(mx.array([tok]), None, caches, step_pos)
            tokens.append(tok)
            fed += 1
            y = sampler(out[0, -1, :])
            if fed - harvester.harvested >= self._decode_interval:
                mx.eval(y, [c.state for c in caches])
                harvester.collect(caches, fed)
                harvester.flush_full(tokens)
        # End-of-generation snapshot: the fed sequence is prompt + generated[:-1].
        harvester.collect(caches, fed)
        harvester.checkpoint(caches, fed)
        harvester.flush_full(tokens)
        harvester.flush_partial(tokens)
        trace.stored_blocks = harvester.stored_blocks
        reply_ids = generated[:-1] if generated and generated[-1] in self._m.eos_ids else generated
        self._ledger.record(request.tenant.namespace, detok.text, reply_ids, request.session_id)
        counters.completion_tokens += len(generated)
        emit(FinishEvent(finish, Usage(n, len(generated), trace.cached_tokens)))


class _ContextLengthError(ValueError):
    pass


def build_engine(settings: EngineSettings) -> ModelRunner:
    """Load the model named by ``settings`` and build its runner and caches."""
    loaded = load_model(settings.model_path, block_size=settings.block_size)
    return ModelRunner(loaded, settings)

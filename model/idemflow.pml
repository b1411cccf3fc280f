/*
 * idemflow's protocol as a SPIN model: one intent (principal, key) under NREQ
 * concurrent requests, NSWEEP sweepers and an environment that lets retention
 * expire and purges. docs/model.md maps every part to the code; read it first.
 *
 * Switches (spin -D…):
 *   MODE=1 two-commit     (claim autocommits; handler + completion in the caller's transaction)
 *   MODE=2 single-commit  (claim in the caller's transaction; commit_phase commits it)
 *   MODE=3 no transaction (run() without transaction=, e.g. Redis: the effect is a provider call)
 *   MODE=4 middleware     (the endpoint commits its own effect, then the completion)
 *   EXT    modes 1-2: the handler also calls an external provider (after a commit_phase)
 *   DK     external calls carry the downstream key (created_at identity); the provider de-duplicates
 *   RECON  the sweeper has a reconciler (Happened / DidNotHappen / Unknown)
 *   TENANT a second principal sends the same key (two records, one per principal)
 *   LIVE   liveness run: the LTL properties below, with pan -a -f (weak fairness)
 *   M_*    one re-introduced bug (see "Mutants" in docs/model.md)
 *
 * Faults: CRASHES, TRANSIENTS, OVERRUNS, UNKNOWNS, STORE_FAILURES, EXPIRIES,
 * UNANSWERED (each 0/1: may it happen at all) and MAXFAULTS (how many of them, of any
 * kinds, in one execution; default 2). Every check explores every
 * interleaving of every combination of up to MAXFAULTS faults.
 *
 * Invariants are asserts whose failing line names them (S1_... to S7_...);
 * docs/model.md lists them with the code they stand for.
 */

#ifndef MODE
#define MODE 1
#endif
#define TC   1
#define SC   2
#define NOTX 3
#define MW   4

#ifndef NREQ
#define NREQ 3
#endif
#ifndef NSWEEP
#define NSWEEP 2
#endif
/* What may go wrong (0/1 each), and how many of those things in one run of the model. */
#ifndef MAXFAULTS
#define MAXFAULTS 2
#endif
#ifndef CRASHES
#define CRASHES 1          /* a request's process dies (at any step) */
#endif
#ifndef TRANSIENTS
#define TRANSIENTS 1       /* the handler answers a transient failure (5xx, exception) */
#endif
#ifndef OVERRUNS
#define OVERRUNS 1         /* the lease expires under a live owner at its completion */
#endif
#ifndef UNKNOWNS
#define UNKNOWNS 1         /* the reconciler cannot tell (or the sweeper dies asking) */
#endif
#ifndef STORE_FAILURES
#define STORE_FAILURES 1   /* the completion cannot be written */
#endif
#ifndef EXPIRIES
#define EXPIRIES 1         /* a record's retention ends (counts as one of MAXFAULTS) */
#endif
#ifndef UNANSWERED
#define UNANSWERED 1       /* the handler ends without an answer after its external call:
                              cancelled past a committed phase, or it raised OutcomeUnknown */
#endif
#ifndef MAXEXP
#define MAXEXP 1           /* retention expiries in all (intents the observer tells apart - 1) */
#endif

#ifdef TENANT
#define NREC 2
#else
#define NREC 1
#endif
/* intents per record the observer can tell apart: one per retention expiry, plus the first */
#define NOI (MAXEXP + 1)

#if MODE == NOTX || MODE == MW
#define EXTERNAL 1         /* the effect is outside the record's transaction */
#define LOCALROW 0
#else
#define LOCALROW 1         /* a business row written in the caller's transaction */
#ifdef EXT
#define EXTERNAL 1
#else
#define EXTERNAL 0
#endif
#endif

#ifdef M_CTA
#if MODE == SC
#error "M_CTA is checked in the autocommit claim modes"
#endif
#endif

/* ---- the record, packed in one int (so a snapshot is one copy) ---------------------- */
#define F(v, o, w)      (((v) >> (o)) & ((1 << (w)) - 1))
#define PUT(v, o, w, x) v = (((v) & ~(((1 << (w)) - 1) << (o))) | ((x) << (o)))
#define ST(v)   F(v, 0, 3)     /* state */
#define TOK(v)  F(v, 3, 2)     /* lease token: the owning request's slot */
#define MARK(v) F(v, 5, 1)     /* the sweeper whose mark it carries */
#define FP(v)   F(v, 6, 1)     /* fingerprint of the intent */
#define RP(v)   F(v, 7, 1)     /* past a recovery point (commit_phase / checkpoint) */
#define EXP(v)  F(v, 8, 1)     /* now >= expires_at */
#define RK(v)   F(v, 9, 2)     /* stored response: none / ok / permanent / transient */
#define RFP(v)  F(v, 11, 1)    /* the stored response answers this fingerprint ... */
#define RPR(v)  F(v, 12, 1)    /* ... of this principal */
#define CA(v)   F(v, 13, 3)    /* created_at identity: what downstream keys derive from */
#define PR(v)   F(v, 16, 1)    /* principal of the record */

#define ABSENT 0
#define INP    1
#define COMP   2
#define PERM   3
#define REL    4
#define STALE  5

#define RNONE  0
#define ROK    1
#define RPERM  2
#define RTRANS 3

#define SETTLED(v)  (ST(v) == COMP || ST(v) == PERM)
/* _model.is_retry / is_past_retention / can_take_over (stores/sql/dialect.py TAKE_OVER_SQL) */
#define IS_RETRY(v, f)  (ST(v) == REL && FP(v) == f)
#define PAST_RET(v)     (EXP(v) && (SETTLED(v) || (ST(v) == REL && !RP(v))))
#ifdef M_RETAKE
/* bug: past retention, any record may be taken over, in flight or being recovered */
#define CODE_PAST(v)    (EXP(v) && ST(v) != ABSENT)
#else
#define CODE_PAST(v)    PAST_RET(v)
#endif
#define TAKE_OVER(v, f) (IS_RETRY(v, f) || CODE_PAST(v))
/* stores/sql/dialect.py PURGEABLE_SQL */
#define PURGEABLE(v)    PAST_RET(v)

/* ---- the world ----------------------------------------------------------------------- */
int  rec[NREC];            /* the committed record of each principal's (principal, key) */
bit  hl[NREC];             /* the holder's lease is fresh: updated_at younger than stale_after */
byte lk[NREC];             /* single-commit: 1 + slot of an uncommitted claim holding the row */
#ifdef LIVE
bit  mh[NREC];             /* a sweeper is resolving its mark (retry_unknown_after not passed) */
#endif
byte nca = 1;              /* created_at identities handed out (0 = none) */
byte hap;                  /* bit c: the effect of the intent created at c happened */

/* ---- the observer (never read by the protocol) ---------------------------------------- */
byte oi[NREC];             /* which intent of the record is current */
bit  ended[NREC];          /* the current intent ended legitimately (purged past retention) */
byte chg[NREC * NOI];      /* effects outside the record's transaction, per intent */
byte row[NREC * NOI];      /* business rows committed, per intent */
bit  answered_[NREQ];      /* the client got a settled answer (a stored response or a 422) */

byte faults, expiries;
#define MAY(kind) ((kind) && faults < MAXFAULTS)

/* Named so that pan's "assertion violated" line says which invariant failed (never set). */
bit S1_one_effect_per_intent, S2_completed_has_its_effect, S3_no_transient_stored,
    S4_no_write_after_take_over, S5_422_only_to_another_request,
    S6_replay_is_this_intents_response, S7_transient_gives_the_key_back,
    BOUND_intents, BOUND_created_at;

/* S3: only settled outcomes are stored; S2: in transactional modes a completed record has its row */
#if LOCALROW
#define S2(r) (!(ST(rec[r]) == COMP && RK(rec[r]) == ROK) || row[(r) * NOI + oi[r]] == 1)
#else
#define S2(r) true
#endif
#define INV(r) assert(RK(rec[r]) != RTRANS || S3_no_transient_stored); \
               assert(S2(r) || S2_completed_has_its_effect)

/* ---- who sends what ------------------------------------------------------------------- */
#ifdef TENANT
#define PRIN(s) ((s) == 2 -> 1 : 0)
#define FPR(s)  0
#else
#define PRIN(s) 0
#define FPR(s)  ((s) == 2 -> 1 : 0)
#endif
#ifdef M_KEYONLY
#define RECOF(s) 0               /* bug: the claim is keyed on the key alone */
#else
#define RECOF(s) PRIN(s)
#endif

/* Owner writes are fenced: our lease, still in progress (stores/sql/dialect._owned_by_caller). */
#define OWNED(r) (ST(rec[r]) == INP && TOK(rec[r]) == me)
#define ME_UNCOMMITTED(r) (lk[r] == me + 1)

/*
 * Steps. Each global action of a request is one atomic block; what the request
 * does between two of them is local and folded into the block before. A crash
 * is decided at the end of a block: dying there or a little later (after
 * other processes moved) is the same for them, since the only thing a live
 * owner's lease prevents is a mark, and everything else stays possible.
 */

/* The process dies: its open transaction rolls back, its lease will expire. */
inline crash_point() {
  if
  :: MAY(CRASHES) ->
     faults++; haverow = 0;
     if :: ME_UNCOMMITTED(r) -> lk[r] = 0 :: else fi;
     if :: owned && OWNED(r) -> hl[r] = 0 :: else fi;
     goto retry
  :: true
  fi
}

/* The run ends without a settled outcome (409, transient, 503): the lease, if
 * still ours, is no longer renewed; the client retries. */
inline run_over() {
  haverow = 0;
  if :: owned && OWNED(r) -> hl[r] = 0 :: else fi;
  goto retry
}

/* The handler has returned. The request timeout bounds it; the completion or
 * release after it (shielded from cancellation) may outlive it: the lease can
 * expire under the live owner here, and only here. */
inline handler_returned() {
  if
  :: MAY(OVERRUNS) && OWNED(r) && hl[r] -> faults++; hl[r] = 0
  :: true
  fi
}

/* A new intent in the observer's eyes, only where the specification allows one. */
inline observe_claim(snap) {
  if
  :: ST(snap) == ABSENT && ended[r] -> oi[r]++; ended[r] = 0
  :: ST(snap) != ABSENT && PAST_RET(snap) && !IS_RETRY(snap, f) -> oi[r]++
  :: else
  fi;
  assert(oi[r] < NOI || BOUND_intents)
}

/* The claimed image of snap: an insert, or a take-over (a new intent resets progress). */
inline claimed_image() {
  mine = snap;
  if
  :: ST(snap) == ABSENT || (CODE_PAST(snap) && !IS_RETRY(snap, f)) ->
     mine = 0; PUT(mine, 13, 3, nca); nca++; assert(nca < 8 || BOUND_created_at)
  :: else
  fi;
  PUT(mine, 0, 3, INP); PUT(mine, 3, 2, me); PUT(mine, 6, 1, f); PUT(mine, 8, 1, 0);
  PUT(mine, 9, 2, RNONE); PUT(mine, 16, 1, p)
}

/* _flow.dispatch on the record the claim found: 422 before 409 before the replay. */
inline dispatch() {
#ifndef M_NOFP
  if
  :: FP(snap) != f -> assert(FP(snap) != f || S5_422_only_to_another_request); goto answered
  :: else
  fi;
#endif
  if
  :: SETTLED(snap) && RK(snap) != RNONE ->
     /* S6: the stored response of this principal's intent, verbatim */
     assert(((RK(snap) == ROK || RK(snap) == RPERM) && RFP(snap) == f && RPR(snap) == p)
            || S6_replay_is_this_intents_response);
     goto answered
  :: else -> goto retry                                             /* 409 */
  fi
}

/* The effect: a provider call (or the middleware endpoint's own commit). */
inline external_effect() {
  if
#ifdef DK
  :: (hap >> myca) & 1 -> verdict = ROK        /* de-duplicated: the first result again */
#endif
  :: else ->
     if
     :: hap = hap | (1 << myca); chg[r * NOI + myoi]++; verdict = ROK;
        assert(chg[r * NOI + myoi] <= 1 || S1_one_effect_per_intent)
     :: verdict = RPERM                         /* declined: nothing happened */
     :: MAY(TRANSIENTS) -> faults++; verdict = RTRANS   /* unavailable: nothing happened */
     fi
  fi
}

/* The handler's own answer when its effect is a local row (uncommitted until the completion). */
inline local_verdict() {
  if
  :: verdict = ROK; haverow = 1
  :: verdict = RPERM
  :: MAY(TRANSIENTS) -> faults++; verdict = RTRANS
  fi
}

/* _Performer._release: roll back, then give the key back with a fenced write if the
 * claim was committed. S7: afterwards the key is not held under our lease. */
inline release_claim() {
  haverow = 0;
  if
  :: ME_UNCOMMITTED(r) -> lk[r] = 0      /* single-commit: the rollback takes the claim */
#if MODE == SC && defined(M_SCNOREL)
  :: !ME_UNCOMMITTED(r) -> skip          /* bug: the commit of commit_phase is forgotten */
#else
  :: !ME_UNCOMMITTED(r) && OWNED(r) -> PUT(rec[r], 0, 3, REL); INV(r)
  :: !ME_UNCOMMITTED(r) && !OWNED(r) -> skip   /* not ours any more: changes nothing */
#endif
  fi;
  assert(!OWNED(r) || S7_transient_gives_the_key_back)
}

/* The handler ends without an answer after its external call, which may or may not have
 * happened: cancelled past a committed phase, or it raised OutcomeUnknown
 * (_flow._outcome_unknown). Its open transaction rolls back; a claim that is durable (every
 * claim here: committed at the claim, or by the commit_phase before the call) stays for the
 * sweeper, never released for a retry to call again; an uncommitted one (single-commit before
 * any phase: not reached here) goes with the rollback. The client is told 503 and retries. */
inline unanswered() {
  if
  :: MAY(UNANSWERED) ->
     faults++;
#ifdef M_RELUNKNOWN
     release_claim();                    /* bug: released, as any exception once was */
#endif
     if :: ME_UNCOMMITTED(r) -> lk[r] = 0 :: else fi;
     run_over()
  :: true
  fi
}

/* The claim (rule 1: one atomic statement; the code branches on its result only). */
inline claim() {
#ifndef M_CTA
  snap = rec[r];
#endif
#if MODE == SC
  if
  :: lk[r] != 0 ->                       /* another's uncommitted claim: bounded wait, then 409 */
     if
     :: ST(snap) == ABSENT || TAKE_OVER(snap, f) -> goto retry
     :: else -> dispatch()
     fi
  :: lk[r] == 0 && (ST(snap) == ABSENT || TAKE_OVER(snap, f)) ->
     claimed_image();                    /* uncommitted: observed when (if) it commits */
     lk[r] = me + 1; owned = 1;
     myoi = oi[r];
     if
     :: (ST(snap) == ABSENT && ended[r]) || (ST(snap) != ABSENT && PAST_RET(snap) && !IS_RETRY(snap, f)) ->
        myoi = oi[r] + 1
     :: else
     fi
  :: else -> dispatch()
  fi;
#elif defined(M_CTA)
  /* bug, second half: act on the check made in an earlier step (an unconditional upsert) */
  claimed_image();
  observe_claim(rec[r]);
  rec[r] = mine; hl[r] = 1; owned = 1; INV(r); myoi = oi[r];
#else
  if
  :: ST(snap) == ABSENT || TAKE_OVER(snap, f) ->
     claimed_image();
     observe_claim(snap);
     rec[r] = mine; hl[r] = 1; owned = 1; INV(r); myoi = oi[r]
  :: else -> dispatch()
  fi;
#endif
  myca = CA(mine); myrp = RP(mine); snap = 0;
#if MODE != SC
  mine = 0
#endif
}

/* The completion: a compare-and-swap on the lease, committed with the caller's
 * transaction (and so with its row) where there is one. */
#define FENCE_OK (ME_UNCOMMITTED(r) || OWNED(r))
inline complete() {
  if
  :: MAY(STORE_FAILURES) ->            /* the store cannot write it */
     faults++;
#if LOCALROW
     if                                  /* the transaction never commits: its effect is gone */
     :: !myrp -> release_claim()
#ifdef M_RELPHASE
     :: myrp -> release_claim()          /* bug: a provider call past the phase stays */
#endif
     :: else                             /* past a committed phase: the sweeper's (_flow) */
     fi;
#elif defined(M_RELNOTX)
     release_claim();                    /* bug: the effect happened, and will run again */
#endif
     run_over()                          /* 503; without a transaction the claim stays */
#ifdef M_UNFENCED
  :: true ->                             /* bug: the completion is not fenced */
#else
  :: FENCE_OK ->
#endif
     assert(FENCE_OK || S4_no_write_after_take_over);
     if
     :: ME_UNCOMMITTED(r) -> observe_claim(rec[r]); rec[r] = mine; lk[r] = 0
     :: else
     fi;
#if !(MODE == TC && defined(M_TWO_TX))
     if :: haverow -> row[r * NOI + myoi]++; assert(row[r * NOI + myoi] <= 1 || S1_one_effect_per_intent) :: else fi;
     haverow = 0;
#endif
     PUT(rec[r], 0, 3, (verdict == RPERM -> PERM : COMP));
     PUT(rec[r], 9, 2, verdict); PUT(rec[r], 11, 1, f); PUT(rec[r], 12, 1, p);
     PUT(rec[r], 8, 1, 0); INV(r);
#if MODE == TC && defined(M_TWO_TX)
     /* bug: the completion committed in a transaction of its own; the row commits next */
     crash_point();
     goto second_commit
#else
     crash_point();                      /* committed, the answer lost: the retry replays */
     goto answered
#endif
  :: !FENCE_OK -> run_over()             /* LeaseLost (409): our transaction rolls back */
  fi
}

proctype Req(byte me) {
  byte r = RECOF(me);
  bit f = FPR(me);
  bit p = PRIN(me);
  int snap, mine;
  bit owned, haverow, myrp;
  byte myca, myoi, verdict;

again:
#define NEW_RUN owned = 0; haverow = 0; myrp = 0; myca = 0; myoi = 0; verdict = RNONE; mine = 0
#ifdef M_CTA
  atomic {                                       /* bug, first half: check ... */
    NEW_RUN; snap = rec[r];
    if :: ST(snap) == ABSENT || TAKE_OVER(snap, f) -> skip :: else -> dispatch() fi
  };
#endif
  atomic {
#ifndef M_CTA
    /* a new run: nothing of the last one is kept (dead values only multiply states) */
    NEW_RUN;
#endif
    claim();
#if MODE == TC && !EXTERNAL
    local_verdict(); handler_returned();
#endif
#if MODE == SC
    if
    :: myrp && !EXTERNAL -> local_verdict()      /* resumed after the recovery point */
    :: !myrp -> local_verdict()                  /* no commit_phase: everything commits once */
    :: !myrp -> skip                             /* commit_phase next */
    :: myrp && EXTERNAL -> skip
    fi;
#endif
    crash_point()
  };
#if MODE == SC && !defined(M_SCRESUME)
  if
  :: myrp && ME_UNCOMMITTED(r) ->
     atomic {          /* resuming past a phase: the take-over commits first (_flow CommitClaim) */
       observe_claim(rec[r]); rec[r] = mine; lk[r] = 0; hl[r] = 1; mine = 0; INV(r);
       crash_point()
     }
  :: else
  fi;
#endif
#if MODE == SC || (MODE == TC && EXTERNAL)
  if
  :: !myrp && verdict == RNONE ->
     atomic {                                    /* commit_phase: checkpoint, then commit */
       if
#if MODE == SC
       :: ME_UNCOMMITTED(r) ->                   /* the first commit: the claim goes with it */
          PUT(mine, 7, 1, 1); observe_claim(rec[r]);
          rec[r] = mine; lk[r] = 0; hl[r] = 1; mine = 0; INV(r)
#endif
       :: !ME_UNCOMMITTED(r) && OWNED(r) -> PUT(rec[r], 7, 1, 1)
       :: else -> run_over()                     /* the checkpoint is fenced: LeaseLost */
       fi;
       myrp = 1;
#if !EXTERNAL
       local_verdict(); handler_returned();
#endif
       crash_point()
     }
  :: else
  fi;
#endif
#if EXTERNAL
  if
  :: verdict == RNONE ->
     atomic {
       external_effect();
       unanswered();
#if LOCALROW
       if :: verdict == ROK -> haverow = 1 :: else fi;
#endif
       handler_returned(); crash_point()
     }
  :: else
  fi;
#endif
  atomic {
#ifndef M_STORE_TRANSIENT
    if
    :: verdict == RTRANS -> release_claim(); run_over()   /* a 503 must not poison the key */
    :: else
    fi;
#endif
    complete()
  };
#if MODE == TC && defined(M_TWO_TX)
second_commit:
  atomic { if :: haverow -> row[r * NOI + myoi]++; haverow = 0 :: else fi; INV(r); goto answered };
#endif
retry:        /* the client sends the same request again */
  goto again;
answered:
  answered_[me] = 1
}

/* ---- the sweeper: mark (one atomic statement), ask, resolve fenced on the mark ---- */
#ifdef M_LOWTHRESH
#define FRESH(r) false           /* bug: stale_after below the request timeout */
#else
#define FRESH(r) hl[r]
#endif
#define DUE_INP(r) (ST(rec[r]) == INP && lk[r] == 0 && !FRESH(r))
#ifdef RECON
#define DUE_REL(r) (ST(rec[r]) == REL && RP(rec[r]) && lk[r] == 0)
#else
#define DUE_REL(r) false
#endif
#ifdef LIVE
#define DUE_ST(r)  (ST(rec[r]) == STALE && !mh[r])
#define BUSY(r, b) mh[r] = b
#else
#define DUE_ST(r)  (ST(rec[r]) == STALE)
#define BUSY(r, b) skip
#endif
#define DUE(r) (DUE_INP(r) || DUE_REL(r) || DUE_ST(r))

#define HAPPENED 1
#define DIDNOT   2
#define UNKNOWN  3

proctype Sweeper(bit me) {
  byte r, answer;
  bit abandoned;
end_idle:
  do
  :: atomic {
       (DUE(0) || DUE(NREC - 1)) ->
       if :: DUE(0) -> r = 0 :: DUE(NREC - 1) -> r = NREC - 1 fi;
       abandoned = (ST(rec[r]) == REL);
       PUT(rec[r], 0, 3, STALE); PUT(rec[r], 5, 1, me); PUT(rec[r], 8, 1, 0);
       BUSY(r, 1); INV(r);
       /* ask the reconciler (it reads the provider right after the mark) */
#ifdef RECON
       if
       :: MAY(UNKNOWNS) -> faults++; answer = UNKNOWN     /* or the sweeper died here */
       :: (hap >> CA(rec[r])) & 1 -> answer = HAPPENED
       :: !((hap >> CA(rec[r])) & 1) -> answer = DIDNOT
       fi
#else
       answer = DIDNOT                                 /* no reconciler: the effect was local */
#endif
     };
     atomic {
       if
       :: answer == UNKNOWN -> skip                   /* stays stale, asked again later */
       :: answer != UNKNOWN && ST(rec[r]) == STALE && MARK(rec[r]) == me ->
          if
          :: answer == HAPPENED ->                     /* settle_stale (+ Happened.apply) */
#if LOCALROW
             row[r * NOI + oi[r]]++; assert(row[r * NOI + oi[r]] <= 1 || S1_one_effect_per_intent);
#endif
             PUT(rec[r], 0, 3, COMP); PUT(rec[r], 9, 2, ROK);
             PUT(rec[r], 11, 1, FP(rec[r])); PUT(rec[r], 12, 1, PR(rec[r]))
          :: else ->                                   /* release_stale */
             PUT(rec[r], 0, 3, REL);
             if :: abandoned -> PUT(rec[r], 7, 1, 0) :: else fi
          fi;
          INV(r)
       :: else -> skip                                 /* re-marked by another: lost */
       fi;
       BUSY(r, 0); answer = 0; abandoned = 0; r = 0
     }
  od
}

/* ---- time: retention ends, purge deletes what it may ---- */
active proctype Clock() {
  byte r;
end_idle:
  do
  :: atomic {
       MAY(EXPIRIES) && expiries < MAXEXP && ST(rec[0]) != ABSENT && !EXP(rec[0]) ->
       faults++; expiries++; PUT(rec[0], 8, 1, 1)
     }
  :: atomic {
       PURGEABLE(rec[0]) && lk[0] == 0 -> rec[0] = 0; ended[0] = 1
     }
  od
}

init {
  byte i = 0;
  atomic {
    do
    :: i < NREQ -> run Req(i); i++
    :: else -> break
    od;
    i = 0;
    do
    :: i < NSWEEP -> run Sweeper(i); i++
    :: else -> break
    od
  }
}

#ifdef LIVE
/* every claim whose lease expired (a crash, an overrun, a 503 that kept it) is resolved */
ltl resolved { [] ((ST(rec[0]) == INP && !hl[0] && lk[0] == 0) ->
                   <> (ST(rec[0]) == COMP || ST(rec[0]) == PERM || ST(rec[0]) == REL)) }
/* every client that keeps retrying the same request gets a settled answer */
ltl answered { <> (answered_[0] && answered_[1] && answered_[2]) }
#endif

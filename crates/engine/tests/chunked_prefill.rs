//! Chunked prefill changes nothing but when work happens.
//!
//! - A prompt fed in pieces of 1, 5, 17 and the rest, each piece in one forward with another
//!   row's decode token, gives bit for bit the logits and tapped hidden states of the same
//!   prompt fed whole (the CPU kernels reduce in one order for every M, and attention over a
//!   row's cache does not depend on how the cache was filled).
//! - Requests admitted with chunked prefill (prompts longer than the step's token budget,
//!   several rows' pieces in one step, pieces riding in the live rows' decode / verify
//!   forward, rows joining mid-run) produce exactly the tokens each produces alone with a
//!   whole prefill (`Batch::admit`), AR and DFlash with the trained drafter; DFlash rows also
//!   accept exactly the same drafts at every block position, so the drafter's context (fed
//!   from the pieces' taps) is exactly what a whole prefill gives it.
//! - On the Qwen 3.5 hybrid (the tiny fixture), where the gated delta rule's form depends on
//!   how a prompt is cut, pieces follow the target's 64-token granule: AR tokens and the
//!   log-probabilities behind every token are bit for bit those of a whole prefill, for
//!   prompts of 3..200 tokens under budgets that cut them differently.
//! - A row with a token limit near the whole context reserves KV cache for what it holds,
//!   not for its limit; cancelling it frees its cache.

mod common;

use std::path::Path;

use common::*;
use dflash_engine::ar::ArDecoder;
use dflash_engine::dflash::{AcceptPolicy, DflashDecoder};
use dflash_engine::session::run_scheduled;
use dflash_engine::{Batch, Completion, Decoder, Event, Request, SamplingParams};
use dflash_models::tokenizer::TextTokenizer;
use dflash_models::{DflashDrafter, LogitRows, RowStep, Target};
use dflash_runtime::Backend;

const TOKENS: usize = 32;
const BLOCK: usize = 16;

/// Runs `req` alone with a whole prefill (`Batch::admit`), as requests ran before chunking.
fn whole_prefill(dec: &mut dyn Decoder, tok: &TextTokenizer, req: &Request) -> Completion {
    let mut batch = Batch::new();
    let mut events = Vec::new();
    batch.admit(dec, tok, 0, req, &mut events).unwrap();
    loop {
        for e in events.drain(..) {
            if let Event::Done { completion, .. } = e {
                return completion;
            }
        }
        batch.step(dec, tok, &mut events).unwrap();
    }
}

#[test]
fn pieces_give_the_logits_and_taps_of_a_whole_prefill() {
    let b = backend();
    let m = default_model(&b);
    let prompt = chat_prompt(&m, PROMPTS[11]);
    let other = chat_prompt(&m, PROMPTS[2]);
    let mut t = m.model;
    t.set_tap_layers(&[1, 14, 27]).unwrap();
    let n = prompt.len();
    assert!(n > 30, "the prompt has {n} tokens");

    let whole = t.new_row(8).unwrap();
    t.forward(&[RowStep {
        row: whole,
        tokens: &prompt,
        logits: LogitRows::All,
        prompt: true,
        argmax_only: false,
    }])
    .unwrap();
    let want_logits = b.to_host(t.logits());
    let want_taps = b.to_host(t.taps());

    // Another row decodes in every forward that carries a piece.
    let busy = t.new_row(8).unwrap();
    t.forward(&[RowStep {
        row: busy,
        tokens: &other,
        logits: LogitRows::None,
        prompt: true,
        argmax_only: false,
    }])
    .unwrap();
    let pieced = t.new_row(8).unwrap();
    let (mut got_logits, mut got_taps) = (Vec::new(), Vec::new());
    let mut at = 0;
    for len in [1, 5, 17, n - 23] {
        t.forward(&[
            RowStep {
                row: busy,
                tokens: &[other[at % other.len()]],
                logits: LogitRows::Last,
                prompt: false,
                argmax_only: false,
            },
            RowStep {
                row: pieced,
                tokens: &prompt[at..at + len],
                logits: LogitRows::All,
                prompt: true,
                argmax_only: false,
            },
        ])
        .unwrap();
        let (l, tp) = (b.to_host(t.logits()), b.to_host(t.taps()));
        let (vocab, width) = (t.vocab(), tp.len() / (len + 1));
        got_logits.extend_from_slice(&l[vocab..]);
        got_taps.extend_from_slice(&tp[width..]);
        at += len;
    }
    assert_eq!(at, n);
    assert_eq!(got_logits.len(), want_logits.len());
    let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
    assert!(
        same(&got_logits, &want_logits),
        "pieced prefill logits differ from the whole prefill's"
    );
    assert!(
        same(&got_taps, &want_taps),
        "pieced prefill taps differ from the whole prefill's"
    );
}

#[test]
fn a_row_reserves_cache_for_what_it_holds_not_its_token_limit() {
    let b = backend();
    let m = default_model(&b);
    let prompt = chat_prompt(&m, PROMPTS[0]);
    let tok = m.tokenizer;
    let mut dec = ArDecoder::new(m.model);
    let ctx = dec.context_length();
    let limit = ctx - prompt.len() - 1;
    let req = request(prompt.clone(), limit, SamplingParams::greedy());
    let mut batch = Batch::new();
    let mut events = Vec::new();
    batch.enqueue(&mut dec, 0, &req).unwrap();
    for _ in 0..4 {
        batch.step(&mut dec, &tok, &mut events).unwrap();
    }
    let kv = dec.kv_usage();
    assert_eq!(kv.rows, 1);
    assert_eq!(kv.positions, prompt.len() + 3, "{kv:?}");
    assert!(
        kv.reserved_positions < 2 * (prompt.len() + 4),
        "a {limit}-token limit in a {ctx}-position context: {kv:?}"
    );
    assert!(kv.bytes > 0);
    assert!(batch.cancel(&mut dec, &tok, 0).is_some());
    assert_eq!(dec.kv_usage(), Default::default());
}

#[test]
fn hybrid_target_pieces_follow_its_granule_exactly() {
    use rand::{Rng, SeedableRng};
    let b = backend();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures/tiny_qwen35");
    let m = dflash_models::load_model(b.clone(), &dir).unwrap();
    assert_eq!(m.model.prefill_granule(), 64);
    let vocab = m.model.vocab() as u32;
    let mut rng = rand::rngs::StdRng::seed_from_u64(64);
    let requests: Vec<Request> = [3, 70, 11, 129, 200, 40, 90]
        .iter()
        .map(|&n| {
            let prompt = (0..n).map(|_| rng.random_range(0..vocab - 3)).collect();
            let mut params = SamplingParams::greedy();
            params.logprobs = Some(0);
            request(prompt, 24, params)
        })
        .collect();
    let tok = m.tokenizer;
    let mut ar = ArDecoder::new(m.model);
    let want: Vec<Completion> = requests
        .iter()
        .map(|r| whole_prefill(&mut ar, &tok, r))
        .collect();
    for (tokens, live) in [(64, 1), (100, 3), (150, 2), (512, 7)] {
        ar.set_batch_tokens(tokens);
        let got = run_scheduled(&mut ar, &tok, &requests, live, &mut |_, _| {}).unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g.tokens, w.tokens,
                "budget {tokens}, {live} rows: request {i}"
            );
            let bits = |c: &Completion| -> Vec<u32> {
                c.logprobs.iter().map(|l| l.logprob.to_bits()).collect()
            };
            assert_eq!(
                bits(g),
                bits(w),
                "budget {tokens}, {live} rows: request {i} log-probabilities"
            );
        }
    }
}

/// Ragged chat prompts plus two longer than every budget below (over 64 tokens).
fn prompts(m: &dflash_models::LoadedModel<Cpu>) -> Vec<Vec<u32>> {
    let mut p: Vec<Vec<u32>> = [5, 7, 11, 12, 1]
        .iter()
        .map(|&q| chat_prompt(m, PROMPTS[q]))
        .collect();
    let long = [8, 16, 19, 0, 6, 14].map(|q| PROMPTS[q]).join(" ");
    p.insert(1, chat_prompt(m, &long));
    let longer = [3, 9, 13, 18, 10, 15, 17, 4].map(|q| PROMPTS[q]).join(" ");
    p.push(chat_prompt(m, &longer));
    p
}

/// Runs `requests` chunked (budget `tokens`, at most `live` rows) and checks every output
/// (tokens, finish, and for DFlash the accepts at every block position) against `want`.
fn check_chunked(
    dec: &mut dyn Decoder,
    tok: &TextTokenizer,
    requests: &[Request],
    want: &[Completion],
    (tokens, live): (usize, usize),
    label: &str,
) {
    dec.set_batch_tokens(tokens);
    let got = run_scheduled(dec, tok, requests, live, &mut |_, _| {}).unwrap();
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.tokens, w.tokens, "{label}: request {i} tokens");
        assert_eq!(
            g.finish_reason, w.finish_reason,
            "{label}: request {i} finish"
        );
        assert_eq!(
            g.stats.accepted_at, w.stats.accepted_at,
            "{label}: request {i} accepts by block position"
        );
        assert_eq!(g.stats.prompt_tokens, requests[i].prompt.len());
    }
    assert_eq!(dec.live_rows(), 0, "{label}: every row was freed");
    assert_eq!(dec.kv_usage().rows, 0, "{label}: every cache row was freed");
}

#[test]
fn chunked_admission_equals_whole_prefill_ar_and_dflash() {
    let b = backend();
    let m = default_model(&b);
    let prompts = prompts(&m);
    let lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
    assert!(lens.iter().filter(|&&n| n > 64).count() >= 2, "{lens:?}");
    let tok = m.tokenizer;
    let requests: Vec<Request> = prompts
        .iter()
        .map(|p| request(p.clone(), TOKENS, SamplingParams::greedy()))
        .collect();

    // AR: B = 1 with a 24-token budget, then 4 rows with 40 (pieces share steps with decodes).
    let mut ar = ArDecoder::new(m.model);
    let want: Vec<Completion> = requests
        .iter()
        .map(|r| whole_prefill(&mut ar, &tok, r))
        .collect();
    check_chunked(&mut ar, &tok, &requests, &want, (24, 1), "AR B=1");
    check_chunked(&mut ar, &tok, &requests, &want, (40, 4), "AR 4 rows");
    check_chunked(&mut ar, &tok, &requests, &want, (512, 7), "AR 7 rows");

    // DFlash with the trained drafter: 3 rows with a 64-token budget (two verify blocks of 16
    // leave 32 for pieces), and every row at once with the default budget.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/drafters/smollm2-135m-instruct-dflash");
    let drafter = DflashDrafter::open(b.clone(), &dir).unwrap();
    let mut df = DflashDecoder::new(ar.target, drafter, BLOCK, AcceptPolicy::PerRow).unwrap();
    let want_df: Vec<Completion> = requests
        .iter()
        .map(|r| whole_prefill(&mut df, &tok, r))
        .collect();
    for (w, a) in want_df.iter().zip(&want) {
        assert_eq!(w.tokens, a.tokens, "DFlash equals AR");
    }
    assert!(
        want_df.iter().map(|c| c.stats.accepted).sum::<usize>() > 0,
        "the trained drafter gets drafts accepted"
    );
    check_chunked(&mut df, &tok, &requests, &want_df, (20, 1), "DFlash B=1");
    check_chunked(&mut df, &tok, &requests, &want_df, (64, 3), "DFlash 3 rows");
    check_chunked(
        &mut df,
        &tok,
        &requests,
        &want_df,
        (512, 7),
        "DFlash 7 rows",
    );
}

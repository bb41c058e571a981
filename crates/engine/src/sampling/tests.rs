use super::*;

fn params(t: f32) -> SamplingParams {
    SamplingParams {
        temperature: t,
        ..Default::default()
    }
}

#[test]
fn greedy_is_a_point_mass_on_the_argmax() {
    let d = SamplingParams::greedy().distribution(&[0.1, 3.0, 2.0], &[], &mut Vec::new());
    assert_eq!(d, Dist::point(1));
}

#[test]
fn temperature_one_is_softmax() {
    let logits = [0.0f32, (2f32).ln(), (3f32).ln()];
    let d = params(1.0).distribution(&logits, &[], &mut Vec::new());
    assert_eq!(
        d.items.iter().map(|x| x.0).collect::<Vec<_>>(),
        vec![0, 1, 2],
        "no filter: id order"
    );
    for (id, want) in [(2u32, 0.5f32), (1, 1.0 / 3.0), (0, 1.0 / 6.0)] {
        assert!((d.prob(id) - want).abs() < 1e-6);
    }
}

#[test]
fn top_k_top_p_min_p_filter_and_renormalise() {
    let logits: Vec<f32> = [0.4f32, 0.3, 0.2, 0.1].iter().map(|p| p.ln()).collect();
    let mut p = params(1.0);
    p.top_k = 2;
    let d = p.distribution(&logits, &[], &mut Vec::new());
    assert_eq!(d.items.len(), 2);
    assert!((d.prob(0) - 4.0 / 7.0).abs() < 1e-6);

    let mut p = params(1.0);
    p.top_p = 0.65;
    let d = p.distribution(&logits, &[], &mut Vec::new());
    assert_eq!(d.items.len(), 2, "0.4 + 0.3 reaches 0.65");

    let mut p = params(1.0);
    p.min_p = 0.6;
    let d = p.distribution(&logits, &[], &mut Vec::new());
    assert_eq!(d.items.len(), 2, "0.3 >= 0.6 * 0.4 > 0.2");
}

#[test]
fn top_p_on_a_large_vocabulary_matches_a_full_sort() {
    let logits: Vec<f32> = (0..5000).map(|i| (i as f32 * 0.7).sin() * 6.0).collect();
    let mut p = params(0.7);
    p.top_p = 0.999_9;
    let d = p.distribution(&logits, &[], &mut Vec::new());
    let max = logits.iter().copied().fold(f32::MIN, f32::max) as f64;
    let mut all: Vec<(u32, f64)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i as u32, ((l as f64 - max) / 0.7).exp()))
        .collect();
    let z: f64 = all.iter().map(|x| x.1).sum();
    all.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut acc = 0.0;
    let n = all
        .iter()
        .position(|x| {
            acc += x.1 / z;
            acc >= 0.999_9
        })
        .unwrap()
        + 1;
    assert!(
        (d.items.len() as i64 - n as i64).abs() <= 1,
        "{} vs {n}",
        d.items.len()
    );
}

#[test]
fn repetition_penalty_follows_hf() {
    let mut p = params(0.0);
    p.repetition_penalty = 2.0;
    let mut logits = vec![4.0f32, -1.0, 3.0];
    p.penalize(&mut logits, &[0, 1, 0]);
    assert_eq!(logits, vec![2.0, -2.0, 3.0]);
    assert_eq!(
        p.distribution(&[4.0, -1.0, 3.0], &[0], &mut Vec::new()),
        Dist::point(2)
    );
}

#[test]
fn invalid_params_are_refused() {
    let cases = [
        SamplingParams {
            temperature: -1.0,
            ..Default::default()
        },
        SamplingParams {
            top_p: 0.0,
            ..Default::default()
        },
        SamplingParams {
            top_p: 1.5,
            ..Default::default()
        },
        SamplingParams {
            min_p: 2.0,
            ..Default::default()
        },
        SamplingParams {
            repetition_penalty: 0.0,
            ..Default::default()
        },
        SamplingParams {
            temperature: f32::NAN,
            ..Default::default()
        },
    ];
    for bad in cases {
        assert!(bad.validate().is_err(), "{bad:?}");
    }
    assert!(SamplingParams::default().validate().is_ok());
}

#[test]
fn same_seed_same_draws() {
    let d = params(1.0).distribution(&[0.0, 0.0, 0.0, 0.0], &[], &mut Vec::new());
    let draw = |seed| {
        let mut s = Sampler::new(seed);
        (0..20).map(|_| s.sample(&d)).collect::<Vec<u32>>()
    };
    let a = draw(7);
    assert_eq!(a, draw(7));
    assert!(a.iter().any(|&x| x != a[0]), "draws vary");
}

#[test]
fn probabilities_by_id_match_lookups() {
    let d = params(0.7).distribution(&[0.5, -1.0, 2.0, 0.0, 1.5], &[], &mut Vec::new());
    let dense = d.probs_by_id();
    assert_eq!(dense.len(), 5);
    for id in 0..5u32 {
        assert_eq!(dense[id as usize], d.prob(id), "id {id}");
    }
    let filtered = Dist {
        items: vec![(3, 0.75), (1, 0.25)],
    };
    assert_eq!(filtered.probs_by_id(), vec![0.0, 0.25, 0.0, 0.75]);
}

#[test]
fn temperatures_that_underflow_are_greedy() {
    // 1 / 1e-39 overflows f32: this used to give NaN probabilities and token 0 every time.
    for t in [1e-39f32, 1e-30, 1e-6] {
        let p = params(t);
        assert!(p.validate().is_ok());
        assert!(p.is_greedy(), "{t}");
        let d = p.distribution(&[0.1, 3.0, 2.0], &[], &mut Vec::new());
        assert_eq!(d, Dist::point(1), "{t}");
    }
    assert!(!params(MIN_TEMPERATURE).is_greedy());
    let d = params(MIN_TEMPERATURE).distribution(&[0.1, 3.0, 2.0], &[], &mut Vec::new());
    assert!(d.items.iter().all(|(_, p)| p.is_finite()));
    assert_eq!(d.prob(1), 1.0);
}

#[test]
fn frequency_and_presence_penalties_subtract_per_count() {
    let p = SamplingParams {
        frequency_penalty: 0.5,
        presence_penalty: 0.25,
        ..Default::default()
    };
    let mut logits = vec![1.0, 1.0, 1.0];
    p.penalize(&mut logits, &[0, 0, 2]);
    assert_eq!(logits, vec![1.0 - 1.0 - 0.25, 1.0, 1.0 - 0.5 - 0.25]);
    // Token 1 was never seen, so greedy now picks it.
    let d = p.distribution(&[1.0, 0.9, 1.0], &[0, 2], &mut Vec::new());
    assert_eq!(d, Dist::point(1));
    for bad in [2.5f32, -2.5, f32::NAN] {
        let f = SamplingParams {
            frequency_penalty: bad,
            ..Default::default()
        };
        assert!(f.validate().is_err(), "{bad}");
        let pr = SamplingParams {
            presence_penalty: bad,
            ..Default::default()
        };
        assert!(pr.validate().is_err(), "{bad}");
    }
    let lp = SamplingParams {
        logprobs: Some(MAX_TOP_LOGPROBS + 1),
        ..Default::default()
    };
    assert!(lp.validate().is_err());
}

#[test]
fn a_point_mass_still_consumes_its_uniform() {
    let mut a = Sampler::new(9);
    assert_eq!(a.sample(&Dist::point(3)), 3);
    let after = a.uniform();
    let mut b = Sampler::new(9);
    b.uniform();
    assert_eq!(after, b.uniform(), "one uniform per sampled token");
}

#[test]
fn pick_runs_in_f64_and_falls_back_to_the_last_positive_item() {
    // In f32, 0.5 + 2^-25 rounds back to 0.5: the second item would be unreachable.
    let d = Dist {
        items: vec![
            (4, 0.5),
            (7, 2f32.powi(-25)),
            (9, 0.5 - 2f32.powi(-25)),
            (2, 0.0),
        ],
    };
    assert_eq!(d.pick(0.0), 4);
    assert_eq!(d.pick(0.5), 7, "0.5 < 0.5 + 2^-25 in f64");
    assert_eq!(d.pick(0.75), 9);
    // A total that rounding left below u: the last item of positive mass, not the zero one.
    let short = Dist {
        items: vec![(1, 0.25), (5, 0.25), (6, 0.0)],
    };
    assert_eq!(short.pick(0.9), 5);
}

/// The filters of `distribution` spelled out over a full sort of the unfiltered
/// probabilities (which the same temperature gives in id order).
fn filtered_reference(p: &SamplingParams, logits: &[f32]) -> Vec<u32> {
    let plain = SamplingParams {
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        ..p.clone()
    };
    let mut items = plain.distribution(logits, &[], &mut Vec::new()).items;
    items.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if p.top_k > 0 {
        items.truncate(p.top_k);
    }
    let mass: f64 = items.iter().map(|x| x.1 as f64).sum();
    let mut acc = 0f64;
    let keep = items
        .iter()
        .position(|x| {
            acc += x.1 as f64;
            acc >= p.top_p as f64 * mass
        })
        .map_or(items.len(), |i| i + 1);
    items.truncate(keep);
    let floor = items[0].1 * p.min_p;
    items.retain(|x| x.1 >= floor);
    items.into_iter().map(|x| x.0).collect()
}

#[test]
fn filters_equal_a_full_sort_also_when_the_head_is_enough() {
    // A peaked vocabulary: the 1024 most likely ids hold more than top-p of the mass, so
    // only that head is sorted; the cut must still be measured against the whole mass.
    let logits: Vec<f32> = (0..20_000)
        .map(|i| {
            let x = (i as f32 * 0.37).sin() * 2.0;
            if i % 19 == 0 {
                x + 9.0
            } else {
                x
            }
        })
        .collect();
    for (top_k, top_p, min_p) in [
        (0, 0.9, 0.0),
        (0, 0.5, 0.0),
        (0, 0.999, 0.0),
        (40, 0.8, 0.0),
        (0, 1.0, 0.01),
        (500, 0.95, 0.001),
    ] {
        let p = SamplingParams {
            temperature: 0.8,
            top_k,
            top_p,
            min_p,
            ..Default::default()
        };
        let d = p.distribution(&logits, &[], &mut Vec::new());
        let ids: Vec<u32> = d.items.iter().map(|x| x.0).collect();
        assert_eq!(ids, filtered_reference(&p, &logits), "{p:?}");
        let mass: f64 = d.items.iter().map(|x| x.1 as f64).sum();
        assert!((mass - 1.0).abs() < 1e-6, "{p:?}: renormalised");
    }
}

#[test]
fn only_plain_greedy_rows_read_just_the_argmax() {
    assert!(SamplingParams::greedy().argmax_only());
    // Filters keep the most likely token: still only the argmax is read.
    let filtered = SamplingParams {
        top_k: 5,
        top_p: 0.5,
        min_p: 0.1,
        ..SamplingParams::greedy()
    };
    assert!(filtered.argmax_only());
    let reads_more = [
        params(0.7),
        SamplingParams {
            repetition_penalty: 1.1,
            ..SamplingParams::greedy()
        },
        SamplingParams {
            frequency_penalty: 0.5,
            ..SamplingParams::greedy()
        },
        SamplingParams {
            presence_penalty: 0.5,
            ..SamplingParams::greedy()
        },
        SamplingParams {
            logprobs: Some(2),
            ..SamplingParams::greedy()
        },
        SamplingParams {
            keep_logits: true,
            ..SamplingParams::greedy()
        },
    ];
    for p in reads_more {
        assert!(!p.argmax_only(), "{p:?}");
    }
}

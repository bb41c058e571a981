use std::path::Path;
use std::sync::Arc;

use super::*;
use crate::source::gguf_writer::GgufWriter;

fn sample() -> GgufWriter {
    let mut w = GgufWriter::new();
    w.meta("general.architecture", MetaValue::Str("llama".into()))
        .meta("llama.block_count", MetaValue::U32(2))
        .meta(
            "tokenizer.ggml.tokens",
            MetaValue::Array(vec![MetaValue::Str("a".into()), MetaValue::Str("b".into())]),
        )
        .tensor("w", &[32, 2], 0, vec![0u8; 32 * 2 * 4])
        .tensor("q", &[64, 1], DType::Q4_1.ggml_id(), vec![0u8; 40]);
    w
}

fn parse(bytes: Vec<u8>) -> Result<GgufFile> {
    GgufFile::parse(Path::new("test.gguf"), Arc::new(bytes))
}

#[test]
fn round_trips_metadata_and_tensors() {
    let f = parse(sample().to_bytes()).unwrap();
    assert_eq!(f.str("general.architecture").unwrap(), "llama");
    assert_eq!(f.u64("llama.block_count").unwrap(), 2);
    assert_eq!(
        f.str_array("tokenizer.ggml.tokens").unwrap(),
        vec!["a", "b"]
    );
    let w = f.weight("w", Some([2, 32])).unwrap();
    assert_eq!((w.rows, w.cols, w.dtype), (2, 32, DType::F32));
    let q = f.weight("q", None).unwrap();
    assert_eq!((q.rows, q.cols, q.dtype), (1, 64, DType::Q4_1));
}

#[test]
fn bad_magic_is_named() {
    let mut b = sample().to_bytes();
    b[0] = b'X';
    assert!(matches!(parse(b), Err(ModelError::NotGguf { .. })));
    assert!(matches!(parse(vec![1, 2]), Err(ModelError::Corrupt { .. })));
}

#[test]
fn unsupported_version_is_refused() {
    let mut b = sample().to_bytes();
    b[4] = 9;
    assert!(matches!(
        parse(b),
        Err(ModelError::GgufVersion { version: 9, .. })
    ));
}

#[test]
fn every_truncation_is_an_error_not_a_panic() {
    let full = sample().to_bytes();
    for cut in 0..full.len() - 1 {
        let r = parse(full[..cut].to_vec());
        assert!(r.is_err(), "truncated at {cut} parsed");
    }
}

#[test]
fn tensor_out_of_bounds_is_detected() {
    let mut w = sample();
    w.tensor("big", &[32, 1000], 0, vec![0u8; 16]);
    let bytes = w.to_bytes();
    match parse(bytes) {
        Err(ModelError::TensorOutOfBounds { name, .. }) => assert_eq!(name, "big"),
        other => panic!("expected out of bounds, got {other:?}"),
    }
}

/// Found by fuzzing: the byte size of a tensor whose value count fits in u64 can overflow
/// (blocks x bytes per block); it used to wrap and pass the bounds check.
#[test]
fn tensor_byte_size_overflow_is_an_error() {
    let mut w = GgufWriter::new();
    // 2^62 f32 values: 2^64 bytes.
    w.tensor("huge", &[1 << 31, 1 << 31], 0, vec![0u8; 16]);
    let Err(err) = parse(w.to_bytes()) else {
        panic!("a tensor of 2^64 bytes was accepted");
    };
    assert!(err.to_string().contains("size overflows"), "{err}");
}

#[test]
fn ragged_quant_rows_and_unknown_types() {
    let mut w = GgufWriter::new();
    w.tensor("ragged", &[48, 1], DType::Q4_1.ggml_id(), vec![0u8; 40]);
    assert!(matches!(
        parse(w.to_bytes()),
        Err(ModelError::Corrupt { .. })
    ));

    let mut w = GgufWriter::new();
    w.tensor("q5", &[32, 1], 6, vec![0u8; 22]);
    let f = parse(w.to_bytes()).unwrap();
    let err = f.weight("q5", None).unwrap_err();
    assert!(err.to_string().contains("Q5_0"), "{err}");
}

#[test]
fn shape_mismatch_and_missing_tensor() {
    let f = parse(sample().to_bytes()).unwrap();
    assert!(matches!(
        f.weight("w", Some([3, 32])),
        Err(ModelError::TensorShape { .. })
    ));
    assert!(matches!(
        f.weight("nope", None),
        Err(ModelError::MissingTensor { .. })
    ));
}

#[test]
fn huge_counts_do_not_allocate() {
    let mut b = sample().to_bytes();
    b[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(matches!(parse(b), Err(ModelError::Corrupt { .. })));
}

//! Dequantization of every GGUF block format against values produced by the `gguf` package
//! (tools/make_quant_fixtures.py).

use dflash_runtime::quant::dequantize_row;
use dflash_runtime::DType;

fn parse_dtype(name: &str) -> DType {
    match name {
        "Q4_0" => DType::Q4_0,
        "Q4_1" => DType::Q4_1,
        "Q8_0" => DType::Q8_0,
        "Q4_K" => DType::Q4K,
        "Q6_K" => DType::Q6K,
        other => panic!("fixture names unknown type {other}"),
    }
}

fn hex_bytes(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

#[test]
fn dequantization_matches_gguf_reference() {
    let text = include_str!("fixtures/quant_golden.json");
    let doc: serde_json::Value = serde_json::from_str(text).unwrap();
    let cases = doc["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 5);
    for case in cases {
        let dtype = parse_dtype(case["dtype"].as_str().unwrap());
        let cols = case["cols"].as_u64().unwrap() as usize;
        let bytes = hex_bytes(case["bytes_hex"].as_str().unwrap());
        assert_eq!(Some(bytes.len()), dtype.row_bytes(cols));
        let expected: Vec<f32> = case["values"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        let mut got = vec![0f32; cols];
        dequantize_row(dtype, &bytes, &mut got);
        for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
            // The reference multiplies then adds; we fuse. One rounding apart at most.
            let tol = 1e-6 + 1e-6 * e.abs();
            assert!(
                (g - e).abs() <= tol,
                "{dtype} value {i}: got {g}, reference {e}"
            );
        }
    }
}

use super::*;

fn f16_bytes(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_bits().to_le_bytes()
}

#[test]
fn q4_1_hand_made_block() {
    let mut block = Vec::new();
    block.extend_from_slice(&f16_bytes(0.5));
    block.extend_from_slice(&f16_bytes(-1.0));
    for j in 0..16u8 {
        block.push(j | ((15 - j) << 4));
    }
    let mut out = [0f32; GROUP];
    decode_group(DType::Q4_1, &block, 0, &mut out);
    for j in 0..16 {
        assert_eq!(out[j], j as f32 * 0.5 - 1.0);
        assert_eq!(out[j + 16], (15 - j) as f32 * 0.5 - 1.0);
    }
}

#[test]
fn q4_0_and_q8_0_hand_made_blocks() {
    let mut q4 = f16_bytes(2.0).to_vec();
    q4.extend(std::iter::repeat_n(0x8F_u8, 16));
    let mut out = [0f32; GROUP];
    decode_group(DType::Q4_0, &q4, 0, &mut out);
    assert!(out[..16].iter().all(|&v| v == 14.0));
    assert!(out[16..].iter().all(|&v| v == 0.0));

    let mut q8 = f16_bytes(0.25).to_vec();
    q8.extend((0..32).map(|i| (i as i8 - 16) as u8));
    decode_group(DType::Q8_0, &q8, 0, &mut out);
    for (i, v) in out.iter().enumerate() {
        assert_eq!(*v, (i as f32 - 16.0) * 0.25);
    }
}

#[test]
fn float_rows_round_trip() {
    let vals: Vec<f32> = (0..64).map(|i| i as f32 * 0.75 - 3.0).collect();
    let f32_bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    let bf16_bytes: Vec<u8> = vals
        .iter()
        .flat_map(|v| half::bf16::from_f32(*v).to_bits().to_le_bytes())
        .collect();
    let f16_bytes: Vec<u8> = vals.iter().flat_map(|v| f16_bytes(*v)).collect();
    for (dtype, bytes) in [
        (DType::F32, f32_bytes),
        (DType::BF16, bf16_bytes),
        (DType::F16, f16_bytes),
    ] {
        let mut out = vec![0f32; 64];
        dequantize_row(dtype, &bytes, &mut out);
        assert_eq!(out, vals, "{dtype}");
    }
}

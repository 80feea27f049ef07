// half.go - bf16/fp16 <-> float32 conversions (round to nearest even) for the
// ParamU16/GradU16 buffers of bf16 and fp16 contexts.

package fsdp

import "math"

// BF16ToFloat32 widens a bfloat16.
func BF16ToFloat32(h uint16) float32 { return math.Float32frombits(uint32(h) << 16) }

// Float32ToBF16 rounds to the nearest bfloat16 (ties to even; NaN stays NaN).
func Float32ToBF16(f float32) uint16 {
	u := math.Float32bits(f)
	if u&0x7fffffff > 0x7f800000 {
		return uint16(u>>16) | 0x40
	}
	return uint16((u + 0x7fff + (u>>16)&1) >> 16)
}

// FP16ToFloat32 widens an IEEE half.
func FP16ToFloat32(h uint16) float32 {
	s := uint32(h&0x8000) << 16
	e := uint32(h>>10) & 0x1f
	m := uint32(h & 0x3ff)
	switch {
	case e == 0x1f:
		return math.Float32frombits(s | 0x7f800000 | m<<13)
	case e != 0:
		return math.Float32frombits(s | (e+112)<<23 | m<<13)
	}
	v := float32(m) * 5.9604644775390625e-08 // subnormal: m * 2^-24
	if s != 0 {
		v = -v
	}
	return v
}

// Float32ToFP16 rounds to the nearest IEEE half (ties to even; overflow to inf).
func Float32ToFP16(f float32) uint16 {
	u := math.Float32bits(f)
	s := uint16(u>>16) & 0x8000
	a := u & 0x7fffffff
	switch {
	case a > 0x7f800000:
		return s | 0x7e00
	case a >= 0x477ff000:
		return s | 0x7c00
	case a < 0x38800000: // subnormal or zero: round a * 2^24 to an integer
		return s | uint16(math.RoundToEven(float64(math.Float32frombits(a))*16777216.0))
	}
	a -= 0x38000000
	return s | uint16((a+0xfff+(a>>13)&1)>>13)
}

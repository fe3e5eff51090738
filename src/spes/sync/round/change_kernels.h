// How far a tensor's values move, ||new - old||^2 in double, for the server's update and drift
// bounds: plain loops over raw arrays with eight interleaved partial sums, combined in a fixed
// order, so a result depends neither on threads nor on the CPU, and the loop is not held up by
// one running sum whose every add waits for the previous one (three times faster here).
// Callers: the check of every arriving upload value (upload_staging.cpp: it also finds NaN and
// Inf, whose sum is not finite) and the owner-copy pass of a round (aggregate.cpp).
// Leaves out: which tensors, and what the sums are compared with (update_bounds.h).
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace spes::sync {

// sum over k of (double(now[k]) - double(old[k]))^2; `now` widened exactly to fp32 first.
double squared_change(const float* now, const float* old, int64_t n);
double squared_change(const c10::BFloat16* now, const float* old, int64_t n);
double squared_change(const c10::Half* now, const float* old, int64_t n);

// The same sum for dst -> src, and then dst = src (the arrays must not overlap).
double copy_with_squared_change(const float* src, float* dst, int64_t n);

}  // namespace spes::sync

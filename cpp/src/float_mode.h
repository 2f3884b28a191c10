// The floating-point mode the format is defined in (FORMAT.md §2: IEEE fp32, round to nearest
// even, subnormals kept), for the duration of a call on this thread. A caller may have set
// flush-to-zero or denormals-are-zero (torch.set_flush_denormal(True), -ffast-math startup code)
// or another rounding mode; the CPU path's bytes and the C ABI's checks of global scales must not
// depend on it. A caller may also have unmasked exceptions (feenableexcept): the checks compute
// 1/g before they refuse a subnormal scale, and the CPU path's exp and divisions overflow and
// divide by zero where the format says so, so the traps are masked too. The guard sets the mode
// and restores the caller's on exit.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace nvfp4kv {

class FloatModeGuard {
 public:
#if defined(__x86_64__) || defined(__i386__)
  // MXCSR: FTZ (bit 15), DAZ (bit 6), rounding control (bits 13-14, 00 = nearest even), the six
  // exception masks (bits 7-12, set = masked).
  FloatModeGuard() : saved_(_mm_getcsr()) {
    const unsigned ieee = (saved_ & ~((1u << 15) | (1u << 6) | (3u << 13))) | (0x3Fu << 7);
    if (ieee != saved_) _mm_setcsr(ieee);
  }
  ~FloatModeGuard() {
    if (_mm_getcsr() != saved_) _mm_setcsr(saved_);
  }

 private:
  unsigned saved_;
#elif defined(__aarch64__)
  // FPCR: FZ (bit 24), FZ16 (bit 19), RMode (bits 22-23, 00 = nearest even), the trap enables
  // IOE, DZE, OFE, UFE, IXE (bits 8-12) and IDE (bit 15), cleared.
  FloatModeGuard() {
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(saved_));
    const unsigned long ieee = saved_ & ~((1ul << 24) | (1ul << 19) | (3ul << 22) | (0x1Ful << 8) | (1ul << 15));
    if (ieee != saved_) __asm__ __volatile__("msr fpcr, %0" ::"r"(ieee));
  }
  ~FloatModeGuard() { __asm__ __volatile__("msr fpcr, %0" ::"r"(saved_)); }

 private:
  unsigned long saved_;
#else
  FloatModeGuard() {}
#endif
  FloatModeGuard(const FloatModeGuard&) = delete;
  FloatModeGuard& operator=(const FloatModeGuard&) = delete;
};

}  // namespace nvfp4kv

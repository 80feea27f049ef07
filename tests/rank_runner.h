// Shared test helpers: N ranks as threads of this process, or as the processes of an mpirun job (when the test
// runs under mpirun), independent fp32<->bf16/fp16 rounding, a deterministic RNG, config/status helpers.
#ifndef FSDP_TESTS_RANK_RUNNER_H
#define FSDP_TESTS_RANK_RUNNER_H

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "fsdp.h"

#ifdef FSDP_TEST_MPI
#include <mpi.h>
#endif

namespace fsdp_test {

// ---- status helpers ------------------------------------------------------

inline std::string last_error_str() {
  const char* e = fsdp_last_error();
  return e ? std::string(e) : std::string("(fsdp_last_error returned NULL)");
}

inline std::string status_str(fsdp_status_t s) {
  const char* n = fsdp_status_name(s);
  return std::string(n ? n : "(NULL)") + " (" + std::to_string(int(s)) + ")";
}

// The message is read first, before any other libfsdp call can replace it.
inline ::testing::AssertionResult status_is(fsdp_status_t got, fsdp_status_t expected, const char* call) {
  const std::string msg = last_error_str();
  if (got != expected)
    return ::testing::AssertionFailure() << call << " returned " << status_str(got) << ", expected "
                                         << status_str(expected) << "; message: " << msg;
  if (got != FSDP_OK && msg.empty()) return ::testing::AssertionFailure() << call << " failed without a message";
  return ::testing::AssertionSuccess();
}

}  // namespace fsdp_test

// The message is read before anything else so that no other libfsdp call can
// replace it first.
#define EXPECT_OK(call)                                                                                    \
  do {                                                                                                     \
    const fsdp_status_t fsdp_ok_s_ = (call);                                                               \
    if (fsdp_ok_s_ != FSDP_OK) {                                                                           \
      const std::string fsdp_ok_m_ = ::fsdp_test::last_error_str();                                        \
      ADD_FAILURE() << #call << " returned " << ::fsdp_test::status_str(fsdp_ok_s_) << ": " << fsdp_ok_m_; \
    }                                                                                                      \
  } while (0)

// Like EXPECT_OK but returns from the enclosing void function (or lambda).
#define ASSERT_OK(call)                                                                             \
  do {                                                                                              \
    const fsdp_status_t fsdp_ok_s_ = (call);                                                        \
    if (fsdp_ok_s_ != FSDP_OK) {                                                                    \
      const std::string fsdp_ok_m_ = ::fsdp_test::last_error_str();                                 \
      FAIL() << #call << " returned " << ::fsdp_test::status_str(fsdp_ok_s_) << ": " << fsdp_ok_m_; \
    }                                                                                               \
  } while (0)

// Expects `call` to return `expected`; a failure must come with a message.
// Streams like EXPECT_TRUE: EXPECT_STATUS(FSDP_ERR_..., f(x)) << "context";
#define EXPECT_STATUS(expected, call) EXPECT_TRUE(::fsdp_test::status_is((call), (expected), #call))

namespace fsdp_test {

// ---- handles ---------------------------------------------------------------

struct ConfigDeleter {
  void operator()(fsdp_config_t* c) const { fsdp_config_destroy(c); }
};
using ConfigPtr = std::unique_ptr<fsdp_config_t, ConfigDeleter>;

struct CtxDeleter {
  void operator()(fsdp_ctx_t* c) const { fsdp_ctx_destroy(c); }
};
using CtxPtr = std::unique_ptr<fsdp_ctx_t, CtxDeleter>;

// A config with exactly the given options set (everything else default).
// Records a test failure (and returns NULL) if an option is refused.
inline ConfigPtr make_config(const std::map<std::string, std::string>& options) {
  fsdp_config_t* cfg = nullptr;
  const fsdp_status_t s = fsdp_config_create(&cfg);
  if (s != FSDP_OK || cfg == nullptr) {
    ADD_FAILURE() << "fsdp_config_create: " << status_str(s) << ": " << last_error_str();
    return ConfigPtr();
  }
  ConfigPtr out(cfg);
  // CTest runs some suites again with options from FSDP_* variables (the mpi
  // ones with each mpi_algorithm); they apply to options a test leaves unset.
  if (std::getenv("FSDP_TEST_CONFIG_FROM_ENV") != nullptr && fsdp_config_from_env(cfg) != FSDP_OK) {
    ADD_FAILURE() << "fsdp_config_from_env: " << last_error_str();
    return ConfigPtr();
  }
  for (const auto& kv : options) {
    const fsdp_status_t st = fsdp_config_set(cfg, kv.first.c_str(), kv.second.c_str());
    if (st != FSDP_OK) {
      ADD_FAILURE() << "fsdp_config_set(" << kv.first << ", " << kv.second << "): " << status_str(st) << ": "
                    << last_error_str();
      return ConfigPtr();
    }
  }
  return out;
}

// ---- ranks -----------------------------------------------------------------

// The world size of the mpirun job this process belongs to, or 0 when it was
// not started by a launcher (then ranks are threads).
inline int launcher_world() {
  const char* v = std::getenv("OMPI_COMM_WORLD_SIZE");
  if (v == nullptr) v = std::getenv("PMI_SIZE");
  return v == nullptr ? 0 : std::atoi(v);
}
inline int launcher_rank() {
  const char* v = std::getenv("OMPI_COMM_WORLD_RANK");
  if (v == nullptr) v = std::getenv("PMI_RANK");
  return v == nullptr ? 0 : std::atoi(v);
}

// Aborts the process with a message if `done` is not set within `seconds`,
// so that a hang in the library is a failure, never a stuck suite.
class Watchdog {
 public:
  explicit Watchdog(double seconds)
      : thread_([this, seconds] {
          std::unique_lock<std::mutex> lock(mu_);
          if (!cv_.wait_for(lock, std::chrono::duration<double>(seconds), [&] { return done_; })) {
            std::fprintf(stderr, "run_ranks: ranks did not finish within %.0f s (hang); aborting\n", seconds);
            std::fflush(stderr);
            std::abort();
          }
        }) {}
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

// Runs fn(rank, group) on `world` threads sharing one local group. gtest
// EXPECT_*/ADD_FAILURE work inside fn (gtest is thread safe on pthreads);
// ASSERT_* returns from fn only. Each failure is tagged with its rank. If the
// ranks have not all returned after `watchdog_s` seconds the process aborts
// with a message.
//
// Under mpirun this process is one rank: fn(its rank, NULL) runs here, and
// contexts created with group NULL take the mpi communicator (comm=auto).
// `world` must then be the job's size. Results the test keeps per rank must
// go through share() before ranks are compared.
inline void run_ranks(int world, const std::function<void(int rank, fsdp_local_group_t* group)>& fn,
                      double watchdog_s = 120.0) {
  auto guarded = [&fn](int r, fsdp_local_group_t* group) {
    SCOPED_TRACE("rank " + std::to_string(r));
    try {
      fn(r, group);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "rank " << r << " threw: " << e.what();
    } catch (...) {
      ADD_FAILURE() << "rank " << r << " threw a non-std exception";
    }
  };
  if (int job = launcher_world(); job > 0) {
    if (job != world) {
      ADD_FAILURE() << "this test needs " << world << " ranks, but it runs under mpirun -np " << job
                    << "; select the tests of that world with --gtest_filter";
      return;
    }
    Watchdog watchdog(watchdog_s);
    guarded(launcher_rank(), nullptr);
    return;
  }
  fsdp_local_group_t* group = nullptr;
  const fsdp_status_t s = fsdp_local_group_create(world, &group);
  if (s != FSDP_OK || group == nullptr) {
    ADD_FAILURE() << "fsdp_local_group_create(" << world << "): " << status_str(s) << ": " << last_error_str();
    return;
  }
  {
    Watchdog watchdog(watchdog_s);
    std::vector<std::thread> threads;
    threads.reserve(size_t(world));
    for (int r = 0; r < world; ++r) threads.emplace_back([&guarded, group, r] { guarded(r, group); });
    for (auto& t : threads) t.join();
  }
  fsdp_local_group_destroy(group);
}

// A meeting of the thread-ranks of one run_ranks world, once: meet() returns
// when every rank has arrived and `fn`, run by rank 0 alone meanwhile, has
// returned. For what no rank may do while another still runs (clear an
// environment variable they read, measure the process between two phases).
// Thread-ranks only: under mpirun each process holds one rank.
class Meeting {
 public:
  explicit Meeting(int world) : world_(world) {}
  void meet(int rank, const std::function<void()>& fn = {}) {
    std::unique_lock<std::mutex> lock(mu_);
    if (++arrived_ == world_) cv_.notify_all();
    cv_.wait(lock, [&] { return arrived_ >= world_; });
    if (rank == 0) {
      if (fn) fn();
      done_ = true;
      cv_.notify_all();
    }
    cv_.wait(lock, [&] { return done_; });
  }

 private:
  const int world_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  bool done_ = false;
};

// Every rank's `mine`, in rank order. With threads there is one process and
// the caller already holds every rank's result: {mine} is returned. Under
// mpirun the ranks' bytes are exchanged (the test's own MPI_Allgatherv, after
// the library initialised MPI).
inline std::vector<std::string> share_bytes(const std::string& mine) {
#ifdef FSDP_TEST_MPI
  if (launcher_world() > 0) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      ADD_FAILURE() << "share_bytes: MPI is not initialised (no mpi context was created)";
      return {mine};
    }
    int n = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    int len = int(mine.size());
    std::vector<int> lens(static_cast<size_t>(n)), offs(static_cast<size_t>(n));
    MPI_Allgather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, MPI_COMM_WORLD);
    int total = 0;
    for (int r = 0; r < n; ++r) {
      offs[size_t(r)] = total;
      total += lens[size_t(r)];
    }
    std::string all(size_t(total), '\0');
    MPI_Allgatherv(mine.data(), len, MPI_BYTE, &all[0], lens.data(), offs.data(), MPI_BYTE, MPI_COMM_WORLD);
    std::vector<std::string> out;
    for (int r = 0; r < n; ++r) out.push_back(all.substr(size_t(offs[size_t(r)]), size_t(lens[size_t(r)])));
    return out;
  }
#else
  if (launcher_world() > 0) ADD_FAILURE() << "share_bytes under mpirun needs a test built with FSDP_TEST_MPI";
#endif
  return {mine};
}

// After run_ranks: fills every rank's slot of `per_rank` (one trivially
// copyable value per rank) from the rank that computed it. A no-op with
// threads, where every slot was written by its thread.
template <typename T>
void share(std::vector<T>& per_rank) {
  if (launcher_world() == 0) return;
  const int me = launcher_rank();
  std::string mine(sizeof(T), '\0');
  std::memcpy(&mine[0], &per_rank[size_t(me)], sizeof(T));
  const auto all = share_bytes(mine);
  for (size_t r = 0; r < all.size() && r < per_rank.size(); ++r) {
    if (all[r].size() == sizeof(T)) std::memcpy(&per_rank[r], all[r].data(), sizeof(T));
  }
}

// share() for vectors of floats (each rank's slot may have its own length).
inline void share_floats(std::vector<std::vector<float>>& per_rank) {
  if (launcher_world() == 0) return;
  const auto& v = per_rank[size_t(launcher_rank())];
  const auto all = share_bytes(std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float)));
  for (size_t r = 0; r < all.size() && r < per_rank.size(); ++r) {
    per_rank[r].resize(all[r].size() / sizeof(float));
    std::memcpy(per_rank[r].data(), all[r].data(), all[r].size());
  }
}

// ---- units -----------------------------------------------------------------

struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;
};

inline size_t numel_of(const std::vector<int64_t>& shape) {
  size_t n = 1;
  for (int64_t d : shape) n *= size_t(d);
  return n;
}

// fsdp_unit_register with the pointer+count arrays built from `params`
// (with `trainable`: fsdp_unit_register_trainable with those flags).
inline fsdp_status_t register_unit(fsdp_ctx_t* ctx, const std::string& name, const std::vector<ParamSpec>& params,
                                   fsdp_unit_t** out, const std::vector<int32_t>* trainable = nullptr) {
  std::vector<const char*> names;
  std::vector<int32_t> ndims;
  std::vector<int64_t> dims;
  for (const auto& p : params) {
    names.push_back(p.name.c_str());
    ndims.push_back(int32_t(p.shape.size()));
    dims.insert(dims.end(), p.shape.begin(), p.shape.end());
  }
  if (trainable != nullptr) {
    return fsdp_unit_register_trainable(ctx, name.c_str(), params.size(), names.data(), ndims.data(), dims.data(),
                                        trainable->data(), out);
  }
  return fsdp_unit_register(ctx, name.c_str(), params.size(), names.data(), ndims.data(), dims.data(), out);
}

// Rank `rank`'s context in `group` with `options` (timeout_s 20 unless
// given) and the units of `specs` registered as unit0, unit1, ... into
// `units`: what the steady-state harnesses open (test_alloc,
// test_host_waits). Empty after a failed assertion.
inline CtxPtr open_units(int rank, fsdp_local_group_t* group, std::map<std::string, std::string> options,
                         const std::vector<std::vector<ParamSpec>>& specs, std::vector<fsdp_unit_t*>* units) {
  options.emplace("timeout_s", "20");
  ConfigPtr cfg = make_config(options);
  EXPECT_TRUE(cfg);
  if (!cfg) return CtxPtr();
  fsdp_ctx_t* raw = nullptr;
  EXPECT_EQ(fsdp_ctx_create(cfg.get(), group, rank, &raw), FSDP_OK) << last_error_str();
  CtxPtr ctx(raw);
  units->assign(specs.size(), nullptr);
  for (size_t k = 0; raw != nullptr && k < specs.size(); ++k) {
    EXPECT_EQ(register_unit(raw, "unit" + std::to_string(k), specs[k], &(*units)[k]), FSDP_OK) << last_error_str();
    if ((*units)[k] == nullptr) return CtxPtr();
  }
  return ctx;
}

// ---- deterministic RNG -----------------------------------------------------

// For a test's own arithmetic on values it owns (its random data, its
// reference model, bit conversions of scalars): not instrumented by
// ThreadSanitizer, whose checks there cannot find anything (one thread owns
// the values) but cost most of a sanitizer run's time (a test_equivalence
// case: 1.2 s of 1.2 s). Loads from and stores into libfsdp's buffers
// (load_elem, add_elem, a test's copies in and out) stay instrumented.
#define FSDP_TEST_OWN_MATH __attribute__((no_sanitize("thread")))

class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  FSDP_TEST_OWN_MATH uint64_t next() {  // splitmix64
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  FSDP_TEST_OWN_MATH float uniform(float lo, float hi) {  // 24 random bits -> [lo, hi)
    const float u = float(next() >> 40) * (1.0f / 16777216.0f);
    return lo + (hi - lo) * u;
  }
  std::vector<float> uniform_vec(size_t n, float lo, float hi) {
    std::vector<float> v(n);
    for (auto& x : v) x = uniform(lo, hi);
    return v;
  }

 private:
  uint64_t state_;
};

// ---- fp32 <-> bf16 / fp16, round to nearest even -----------------------------

FSDP_TEST_OWN_MATH inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
FSDP_TEST_OWN_MATH inline float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

FSDP_TEST_OWN_MATH inline uint16_t f32_to_bf16(float f) {
  uint32_t x = f32_bits(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((x >> 16) | 0x0040u);  // quiet NaN
  x += 0x7FFFu + ((x >> 16) & 1u);  // ties go to the even upper half; overflow carries to Inf
  return uint16_t(x >> 16);
}
inline float bf16_to_f32(uint16_t h) { return f32_from_bits(uint32_t(h) << 16); }

FSDP_TEST_OWN_MATH inline uint16_t f32_to_fp16(float f) {
  const uint32_t x = f32_bits(f);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
  const uint32_t a = x & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return uint16_t(sign | 0x7E00u);   // NaN (quiet)
  if (a >= 0x477FF000u) return uint16_t(sign | 0x7C00u);  // >= 65520 rounds to Inf
  if (a < 0x38800000u) {
    // Below 2^-14: fp16 subnormal (or zero), a multiple of 2^-24. The scaling
    // is exact and nearbyint rounds half to even in the default mode.
    const float units = std::nearbyint(std::fabs(f) * 16777216.0f);
    return uint16_t(sign | uint16_t(units));  // 1024 units is the smallest normal
  }
  const uint32_t exp = (a >> 23) - 127u + 15u;
  const uint32_t mant = a & 0x7FFFFFu;
  uint32_t h = (exp << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // may carry into the exponent
  return uint16_t(sign | h);
}
FSDP_TEST_OWN_MATH inline float fp16_to_f32(uint16_t h) {
  const float sign = (h & 0x8000u) ? -1.0f : 1.0f;
  const int exp = (h >> 10) & 0x1F;
  const int mant = h & 0x3FF;
  if (exp == 0) return sign * std::ldexp(float(mant), -24);
  if (exp == 31) return mant ? std::copysign(NAN, sign) : sign * INFINITY;
  return sign * std::ldexp(float(1024 + mant), exp - 25);
}

inline size_t dtype_nbytes(fsdp_dtype_t dt) { return dt == FSDP_DTYPE_FP32 ? 4 : 2; }

inline const char* dtype_config_name(fsdp_dtype_t dt) {
  return dt == FSDP_DTYPE_FP32 ? "fp32" : dt == FSDP_DTYPE_BF16 ? "bf16" : "fp16";
}

// The value `f` takes once stored in `dt`.
inline float round_to(fsdp_dtype_t dt, float f) {
  switch (dt) {
    case FSDP_DTYPE_BF16:
      return bf16_to_f32(f32_to_bf16(f));
    case FSDP_DTYPE_FP16:
      return fp16_to_f32(f32_to_fp16(f));
    default:
      return f;
  }
}

// Element i of a buffer in `dt`, as fp32.
inline float load_elem(const void* buf, size_t i, fsdp_dtype_t dt) {
  switch (dt) {
    case FSDP_DTYPE_BF16:
      return bf16_to_f32(static_cast<const uint16_t*>(buf)[i]);
    case FSDP_DTYPE_FP16:
      return fp16_to_f32(static_cast<const uint16_t*>(buf)[i]);
    default:
      return static_cast<const float*>(buf)[i];
  }
}

// buf[i] += g, computed in fp32 and rounded to `dt`.
inline void add_elem(void* buf, size_t i, fsdp_dtype_t dt, float g) {
  const float v = load_elem(buf, i, dt) + g;
  switch (dt) {
    case FSDP_DTYPE_BF16:
      static_cast<uint16_t*>(buf)[i] = f32_to_bf16(v);
      break;
    case FSDP_DTYPE_FP16:
      static_cast<uint16_t*>(buf)[i] = f32_to_fp16(v);
      break;
    default:
      static_cast<float*>(buf)[i] = v;
      break;
  }
}

// max_i |a_i - b_i| / max_i |ref_i| (ref = b); 0/0 counts as 0.
inline double rel_max_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    num = std::max(num, std::fabs(double(a[i]) - double(b[i])));
    den = std::max(den, std::fabs(double(b[i])));
  }
  if (a.size() != b.size()) return INFINITY;
  return den > 0 ? num / den : num;
}

}  // namespace fsdp_test

#endif  // FSDP_TESTS_RANK_RUNNER_H

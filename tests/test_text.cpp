// Proves that the text libfsdp reads and writes does not depend on the host:
// numbers in options, environment variables, traces, messages and checkpoint
// metadata keep the C locale's syntax when the host switched to a locale with
// a decimal comma (de_DE); unit and param names that a checkpoint or another
// language could not hold are refused at registration; user strings in
// messages are escaped and cut, so a 1 MiB key does not make a 1 MiB message.
#include <sys/stat.h>
#include <unistd.h>
#include <clocale>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <locale>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "rank_runner.h"

using namespace fsdp_test;

// Read by LeakSanitizer (asan preset): glibc's setlocale keeps the list of
// directories it parsed from LOCPATH for the life of the process, and these
// tests point LOCPATH at the locale they compile.
extern "C" __attribute__((visibility("default"))) const char* __lsan_default_suppressions() {
  return "leak:__argz_add_sep\n";
}

namespace {

bool contains(const std::string& hay, const std::string& needle) { return hay.find(needle) != std::string::npos; }

std::string get_option(const fsdp_config_t* cfg, const char* key) {
  char buf[256] = {0};
  EXPECT_OK(fsdp_config_get(cfg, key, buf, sizeof buf, nullptr));
  return buf;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// ---- a locale with a decimal comma ---------------------------------------------

bool has_decimal_comma(const char* name) {
  if (std::setlocale(LC_ALL, name) == nullptr) return false;
  const bool comma = std::string(std::localeconv()->decimal_point) == ",";
  std::setlocale(LC_ALL, "C");
  return comma;
}

// The name of an installed locale whose decimal point is ',' or, when the
// machine has none, de_DE.UTF-8 compiled with localedef (from Debian's
// `locales` data) into a directory that LOCPATH then points at. "" and the
// reason in `why` when neither works.
std::string decimal_comma_locale(std::string* why) {
  static std::string found, reason;
  static bool tried = false;
  if (tried) {
    *why = reason;
    return found;
  }
  tried = true;
  for (const char* name : {"de_DE.UTF-8", "de_DE.utf8", "fr_FR.UTF-8", "fr_FR.utf8"}) {
    if (has_decimal_comma(name)) return found = name;
  }
  const char* tmp = std::getenv("TMPDIR");
  const std::string dir = std::string(tmp != nullptr ? tmp : "/tmp") + "/fsdp-test-locales-" + std::to_string(getuid());
  // glibc remembers a locale it failed to find, so it is looked up only once
  // it exists. Built beside and renamed into place, so that tests running in
  // parallel never see half a locale.
  struct stat st {};
  int rc = 0;
  if (::stat((dir + "/de_DE.UTF-8").c_str(), &st) != 0) {
    const std::string part = dir + ".part" + std::to_string(getpid());
    const std::string cmd = "mkdir -p '" + part + "' && localedef -i de_DE -f UTF-8 '" + part +
                            "/de_DE.UTF-8' >/dev/null 2>&1 && { mv -T '" + part + "' '" + dir +
                            "' 2>/dev/null || true; }; rm -rf '" + part + "'";
    rc = std::system(cmd.c_str());
  }
  setenv("LOCPATH", dir.c_str(), 1);
  if (!has_decimal_comma("de_DE.UTF-8")) {
    unsetenv("LOCPATH");
    reason = "no locale with a decimal comma is installed and `localedef -i de_DE -f UTF-8` into " + dir +
             " failed (exit " + std::to_string(rc) + "); install Debian's `locales` package (tools/deps.sh does)";
    *why = reason;
    return "";
  }
  return found = "de_DE.UTF-8";
}

// The host program's side: setlocale(LC_ALL, ...) for C and the C++ global
// locale (which also sets C's), as a German host would run.
class DecimalComma : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    const std::string name = decimal_comma_locale(&why);
    if (name.empty()) GTEST_SKIP() << why;
    std::locale::global(std::locale(name));
    char buf[16];
    std::snprintf(buf, sizeof buf, "%.1f", 2.5);
    ASSERT_EQ(std::string(buf), "2,5") << "the test locale " << name << " does not write a decimal comma";
    std::ostringstream os;
    os << 1234567;
    ASSERT_NE(os.str(), "1234567") << "the C++ global locale should group digits";
  }
  void TearDown() override { std::locale::global(std::locale::classic()); }

  // A config made in the C locale, so that a test of what libfsdp writes
  // does not depend on what it reads.
  static ConfigPtr config_set_in_c_locale(const std::map<std::string, std::string>& options) {
    std::locale host = std::locale::global(std::locale::classic());
    ConfigPtr cfg = make_config(options);
    std::locale::global(host);
    return cfg;
  }
};

TEST_F(DecimalComma, OptionsAndEnvironmentVariablesTakeNumbersInTheCLocaleSyntax) {
  ConfigPtr cfg = make_config({});
  ASSERT_TRUE(cfg);
  EXPECT_OK(fsdp_config_set(cfg.get(), "lr", "0.002"));
  EXPECT_EQ(get_option(cfg.get(), "lr"), "0.002");
  EXPECT_OK(fsdp_config_set(cfg.get(), "timeout_s", "2.5"));
  EXPECT_EQ(get_option(cfg.get(), "timeout_s"), "2.5");
  EXPECT_OK(fsdp_config_set(cfg.get(), "beta2", " 9.5e-1\t"));  // spaces around are fine
  EXPECT_EQ(get_option(cfg.get(), "beta2"), "0.95");
  EXPECT_OK(fsdp_config_set(cfg.get(), "loss_scale", "+1024.5"));
  EXPECT_EQ(get_option(cfg.get(), "loss_scale"), "1024.5");
  // The locale's own syntax is refused, as it would be anywhere else.
  for (const char* bad : {"0,1", "1.000,5", "0x1p-3", "inf", "nan", "1e", "--1", "+-1"}) {
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_config_set(cfg.get(), "weight_decay", bad)) << bad;
  }
  EXPECT_EQ(get_option(cfg.get(), "weight_decay"), "0");
  // A sign after the '+' is no number, even where its value would be in range.
  for (const char* bad : {"+-0", "+-0.5", "++0.5", "+"}) {
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_config_set(cfg.get(), "momentum", bad)) << bad;
  }
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_config_set(cfg.get(), "shard_group_size", "+-0"));
  EXPECT_EQ(get_option(cfg.get(), "momentum"), "0");
  EXPECT_OK(fsdp_config_set(cfg.get(), "momentum", "+0.5"));
  EXPECT_EQ(get_option(cfg.get(), "momentum"), "0.5");
  EXPECT_OK(fsdp_config_set(cfg.get(), "weight_decay", "0.1"));
  EXPECT_EQ(get_option(cfg.get(), "weight_decay"), "0.1");

  setenv("FSDP_LR", "3e-4", 1);
  setenv("FSDP_MAX_GRAD_NORM", "0.75", 1);
  EXPECT_OK(fsdp_config_from_env(cfg.get()));
  unsetenv("FSDP_LR");
  unsetenv("FSDP_MAX_GRAD_NORM");
  EXPECT_EQ(get_option(cfg.get(), "lr"), "3e-4");  // the shortest text that reads back the same
  EXPECT_EQ(get_option(cfg.get(), "max_grad_norm"), "0.75");
}

// Enough steps for more than 1000 trace records: a grouping locale would
// write seq 1000 as "1.000".
TEST_F(DecimalComma, TheTraceIsStrictJsonWithPointsAndNoDigitGrouping) {
  const std::string prefix = ::testing::TempDir() + "fsdp_locale_trace_" + std::to_string(::getpid());
  run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
    ConfigPtr cfg = config_set_in_c_locale({{"timeout_s", "30"}, {"lr", "0.01"}});
    ASSERT_TRUE(cfg);
    fsdp_ctx_t* raw = nullptr;
    ASSERT_OK(fsdp_ctx_create(cfg.get(), group, rank, &raw));
    CtxPtr ctx(raw);
    std::vector<fsdp_unit_t*> units(3);
    for (size_t k = 0; k < units.size(); ++k) {
      ASSERT_OK(register_unit(raw, "layer" + std::to_string(k), {{"w", {17, 5}}, {"b", {17}}}, &units[k]));
    }
    ASSERT_OK(fsdp_trace_begin(raw));
    for (int step = 0; step < 40; ++step) {
      for (fsdp_unit_t* u : units) {
        ASSERT_OK(fsdp_forward_begin(u, nullptr));
        ASSERT_OK(fsdp_forward_end(u, nullptr));
      }
      for (size_t k = units.size(); k-- > 0;) {
        ASSERT_OK(fsdp_backward_begin(units[k], nullptr));
        void* g = nullptr;
        ASSERT_OK(fsdp_grad_ptr(units[k], 0, &g));
        static_cast<float*>(g)[0] = 0.5f;
        ASSERT_OK(fsdp_backward_end(units[k], nullptr));
      }
      ASSERT_OK(fsdp_step(raw, nullptr));
    }
    const std::string path = prefix + std::to_string(rank) + ".json";
    ASSERT_OK(fsdp_trace_write(raw, path.c_str()));
    EXPECT_OK(fsdp_ctx_finalize(raw));
  });
  for (int rank = 0; rank < 2; ++rank) {
    const std::string text = read_file(prefix + std::to_string(rank) + ".json");
    EXPECT_FALSE(std::regex_search(text, std::regex("\"ts\": [0-9]+,[0-9]"))) << "a decimal comma in a timestamp";
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(text);  // strict: throws on anything that is not JSON
    } catch (const std::exception& e) {
      ADD_FAILURE() << "rank " << rank << "'s trace is not valid JSON: " << e.what();
      continue;
    }
    int64_t next_seq = 0;
    size_t events = 0;
    for (const auto& ev : j.at("traceEvents")) {
      if (ev.at("ph") == "M") continue;
      ++events;
      EXPECT_TRUE(ev.at("ts").is_number()) << ev.dump();
      EXPECT_EQ(ev.at("pid"), rank);
      ASSERT_TRUE(ev.at("args").at("seq").is_number_integer()) << ev.dump();
      EXPECT_EQ(ev.at("args").at("seq").get<int64_t>(), next_seq++) << ev.dump();
    }
    EXPECT_GT(events, 1000u) << "too few records to show digit grouping";
  }
}

TEST_F(DecimalComma, TimeoutMessagesAndCheckpointMetadataWriteAPoint) {
  const std::string dir = ::testing::TempDir() + "fsdp_locale_ckpt_" + std::to_string(::getpid());
  run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
    ConfigPtr cfg = config_set_in_c_locale({{"timeout_s", "2.5"}, {"lr", "0.002"}});
    ASSERT_TRUE(cfg);
    fsdp_ctx_t* raw = nullptr;
    ASSERT_OK(fsdp_ctx_create(cfg.get(), group, rank, &raw));
    CtxPtr ctx(raw);
    fsdp_unit_t* u = nullptr;
    ASSERT_OK(register_unit(raw, "u", {{"w", {9}}}, &u));
    ASSERT_OK(fsdp_save(raw, dir.c_str(), "sharded"));
    ASSERT_OK(fsdp_load(raw, dir.c_str()));
    if (rank == 0) {
      // Rank 1 never joins this gather.
      EXPECT_STATUS(FSDP_ERR_TIMEOUT, fsdp_forward_begin(u, nullptr));
      EXPECT_TRUE(contains(last_error_str(), "after 2.5 s")) << last_error_str();
    }
  });
  const nlohmann::json meta = nlohmann::json::parse(read_file(dir + "/fsdp_checkpoint.json"));
  EXPECT_EQ(meta.at("optimizer").at("lr").get<double>(), 0.002);
}

// ---- names -------------------------------------------------------------------

TEST(Names, NamesThatAreNotUtf8OrHoldControlCharactersAreRefusedAtRegistration) {
  struct Bad {
    std::string unit, param, says;
  };
  const std::vector<Bad> bad = {
      {"\xff\xfe", "w", "the unit name is not valid UTF-8 (\\xff at byte 0)"},
      {"u", "w\xc3", "names[1] 'w\\xc3' is not valid UTF-8 (\\xc3 at byte 1)"},           // cut sequence
      {"u", "\xc0\xaf", "names[1] '\\xc0\\xaf' is not valid UTF-8"},                      // overlong '/'
      {"u", "\xed\xa0\x80", "names[1] '\\xed\\xa0\\x80' is not valid UTF-8"},             // a surrogate
      {"u", "a\tb", "names[1] 'a\\x09b' holds a control character (\\x09 at byte 1)"},    // tab
      {"line\nbreak", "w", "the unit name holds a control character (\\x0a at byte 4)"},  // newline
      {"u", "del\x7f", "names[1] 'del\\x7f' holds a control character"}};
  const std::string dir = ::testing::TempDir() + "fsdp_names_ckpt_" + std::to_string(::getpid());
  run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
    ConfigPtr cfg = make_config({{"timeout_s", "20"}});
    ASSERT_TRUE(cfg);
    fsdp_ctx_t* raw = nullptr;
    ASSERT_OK(fsdp_ctx_create(cfg.get(), group, rank, &raw));
    CtxPtr ctx(raw);
    for (const Bad& b : bad) {
      fsdp_unit_t* u = nullptr;
      EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, register_unit(raw, b.unit, {{"b", {2}}, {b.param, {3}}}, &u));
      EXPECT_TRUE(contains(last_error_str(), b.says)) << last_error_str() << "\nexpected: " << b.says;
      EXPECT_NO_THROW((void)nlohmann::json(last_error_str()).dump()) << "the message itself is not UTF-8";
      EXPECT_EQ(u, nullptr);
    }
    // Any other UTF-8 is a name, and checkpoints of both kinds hold it.
    fsdp_unit_t* u = nullptr;
    ASSERT_OK(register_unit(raw, "層 0 — ß", {{"gewicht.ä", {3}}, {"😀.bias", {2}}}, &u));
    const std::vector<float> w = {1.5f, -2.f, 3.25f}, b = {0.5f, 4.f};
    ASSERT_OK(fsdp_param_set_values(u, 0, w.data(), w.size()));
    ASSERT_OK(fsdp_param_set_values(u, 1, b.data(), b.size()));
    ASSERT_OK(fsdp_save(raw, (dir + "_full").c_str(), "full"));
    ASSERT_OK(fsdp_save(raw, (dir + "_sharded").c_str(), "sharded"));
    ASSERT_OK(fsdp_load(raw, (dir + "_full").c_str()));
    std::vector<float> got(3);
    ASSERT_OK(fsdp_gather_param(u, 0, got.data(), got.size()));
    EXPECT_EQ(got, w);
    EXPECT_OK(fsdp_ctx_finalize(raw));
  });
  const std::string model = read_file(dir + "_full/model.safetensors");
  ASSERT_GT(model.size(), 8u);
  uint64_t n = 0;
  std::memcpy(&n, model.data(), 8);
  const nlohmann::json header = nlohmann::json::parse(model.substr(8, n));
  EXPECT_TRUE(header.contains("gewicht.ä")) << header.dump();
  EXPECT_TRUE(header.contains("😀.bias")) << header.dump();
}

// ---- messages ------------------------------------------------------------------

TEST(Messages, AHugeUserStringIsQuotedCutAndItsLengthGiven) {
  const std::string huge(1 << 20, 'k');
  // Paths are quoted up to PATH_MAX (4096 bytes), other strings up to 200.
  auto bounded = [&](const char* what, const char* said = "(1048576 bytes)") {
    const std::string msg = last_error_str();
    EXPECT_LT(msg.size(), 5000u) << what << ": " << msg.substr(0, 300);
    EXPECT_TRUE(contains(msg, said)) << what << ": " << msg.substr(0, 300);
  };
  ConfigPtr cfg = make_config({});
  ASSERT_TRUE(cfg);
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_config_set(cfg.get(), huge.c_str(), "1"));
  bounded("an unknown key");
  EXPECT_TRUE(contains(last_error_str(), "'" + huge.substr(0, 200) + "...'")) << "the first 200 bytes are quoted";
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_config_set(cfg.get(), "lr", huge.c_str()));
  bounded("a bad value");
  char buf[8];
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_config_get(cfg.get(), huge.c_str(), buf, sizeof buf, nullptr));
  bounded("fsdp_config_get");
  setenv("FSDP_OPTIMIZER", huge.c_str(), 1);
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_config_from_env(cfg.get()));
  unsetenv("FSDP_OPTIMIZER");
  bounded("an environment variable");

  fsdp_ctx_t* raw = nullptr;
  ASSERT_OK(fsdp_ctx_create(cfg.get(), nullptr, 0, &raw));
  CtxPtr ctx(raw);
  fsdp_unit_t* u = nullptr;
  ASSERT_OK(register_unit(raw, huge, {{"w", {3}}}, &u));  // a long name is a name
  EXPECT_STATUS(FSDP_ERR_INVALID_STATE, fsdp_forward_end(u, nullptr));
  bounded("a unit's name");
  fsdp_unit_t* twice = nullptr;
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, register_unit(raw, "v", {{huge, {1}}, {huge, {1}}}, &twice));
  bounded("a param name given twice");
  const std::string long_path = "/tmp/" + huge;
  EXPECT_NE(fsdp_save(raw, long_path.c_str(), "sharded"), FSDP_OK);
  bounded("a checkpoint directory", "bytes)");
  EXPECT_NE(fsdp_load(raw, long_path.c_str()), FSDP_OK);
  bounded("fsdp_load's directory", "bytes)");
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_save(raw, "/tmp/x", huge.c_str()));
  bounded("a checkpoint kind");
  ASSERT_OK(fsdp_trace_begin(raw));
  EXPECT_STATUS(FSDP_ERR_IO, fsdp_trace_write(raw, long_path.c_str()));
  bounded("a trace path", "bytes)");
}

TEST(Messages, BytesThatAreNotUtf8OrControlCharactersAreEscaped) {
  ConfigPtr cfg = make_config({});
  ASSERT_TRUE(cfg);
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_config_set(cfg.get(), "sharding", "FULL\xff\n\x1b[31mSHARD"));
  const std::string msg = last_error_str();
  EXPECT_TRUE(contains(msg, "'FULL\\xff\\x0a\\x1b[31mSHARD'")) << msg;
  EXPECT_NO_THROW((void)nlohmann::json(msg).dump()) << "the message is not valid UTF-8";
  // A long UTF-8 string is cut at a character boundary, never inside one.
  std::string wide;
  for (int i = 0; i < 150; ++i) wide += "é";  // 300 bytes
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_config_set(cfg.get(), "optimizer", wide.c_str()));
  EXPECT_TRUE(contains(last_error_str(), "(300 bytes)")) << last_error_str();
  EXPECT_NO_THROW((void)nlohmann::json(last_error_str()).dump()) << "cut inside a character";
}

}  // namespace

// ---- numeric options: the check, the message and the docs say the same ---------

namespace {

// The row of docs/configuration.md's option table that starts with `key`.
std::string doc_row(const std::string& key) {
  std::istringstream doc(read_file(std::string(FSDP_DOCS_DIR) + "/configuration.md"));
  for (std::string line; std::getline(doc, line);) {
    if (line.rfind("| `" + key + "`", 0) == 0) return line;
  }
  return "";
}

std::string c_number(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", v);  // this test runs in the C locale
  return buf;
}

}  // namespace

TEST(Config, EveryNumericRangeInAMessageIsTheOneCheckedAndTheOneDocumented) {
  const std::vector<std::string> keys = {"lr",
                                         "beta1",
                                         "beta2",
                                         "eps",
                                         "weight_decay",
                                         "momentum",
                                         "max_grad_norm",
                                         "timeout_s",
                                         "loss_scale",
                                         "loss_scale_init",
                                         "loss_scale_growth",
                                         "loss_scale_backoff",
                                         "align_bytes",
                                         "threads",
                                         "shard_group_size",
                                         "world_size",
                                         "limit_all_gathers",
                                         "gather_block",
                                         "loss_scale_growth_interval"};
  const std::regex range(R"(in ([\[(])([-+0-9.e]+), ([-+0-9.e]+)([\])]))");
  for (const std::string& key : keys) {
    SCOPED_TRACE(key);
    ConfigPtr cfg = make_config({});
    ASSERT_TRUE(cfg);
    ASSERT_EQ(fsdp_config_set(cfg.get(), key.c_str(), "x"), FSDP_ERR_INVALID_ARGUMENT);
    const std::string msg = last_error_str();
    const size_t at = msg.find("; valid: ");
    ASSERT_NE(at, std::string::npos) << msg;
    const std::string valid = msg.substr(at + 9);
    std::smatch m;
    ASSERT_TRUE(std::regex_search(valid, m, range)) << "no range in: " << msg;
    const double lo = std::stod(m[2]), hi = std::stod(m[3]);
    const bool hi_open = m[4] == ")";
    const bool integer = valid.find("integer") != std::string::npos || valid.find("power of two") != std::string::npos;
    auto accepts = [&](double v) { return fsdp_config_set(cfg.get(), key.c_str(), c_number(v).c_str()) == FSDP_OK; };
    EXPECT_TRUE(accepts(lo)) << valid;
    EXPECT_EQ(accepts(hi), !hi_open) << valid;
    if (integer) {
      EXPECT_FALSE(accepts(lo - 1)) << valid;
      EXPECT_FALSE(accepts(hi * 2)) << valid;
    } else {
      EXPECT_FALSE(accepts(std::nextafter(lo, -INFINITY))) << valid;
      EXPECT_FALSE(accepts(std::nextafter(hi, INFINITY))) << valid;
      if (hi_open) {
        EXPECT_TRUE(accepts(std::nextafter(hi, -INFINITY))) << valid;
      }
    }
    const std::string row = doc_row(key);
    ASSERT_FALSE(row.empty()) << "docs/configuration.md has no row for " << key;
    EXPECT_TRUE(contains(row, valid)) << "docs/configuration.md says:\n" << row << "\nthe message says: " << valid;
  }
}

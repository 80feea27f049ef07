// src/base/text.h - text that libfsdp reads or writes, independent of the
// host's locale: numbers in the C locale's syntax whatever LC_NUMERIC or the
// C++ global locale say (a host that calls setlocale(LC_ALL, "de_DE.UTF-8")
// must still be able to set lr=0.002 and get valid JSON traces), user strings
// quoted in messages with a bounded length, and the rule for names.
// Below core, device, comm and ckpt: it knows none of them.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace fsdp::base {

// The whole of `s` as a decimal number: an optional sign, digits with an
// optional '.', an optional exponent ("0.002", "-1.5e-3", "+2"), or inf/nan.
// No spaces, no hex, no thousands separators, whatever the locale. False if
// `s` is anything else or out of double's range.
bool parse_double(std::string_view s, double* out);
// The whole of `s` as a decimal integer (optional sign); false otherwise or
// on overflow.
bool parse_long(std::string_view s, long* out);
// The shortest text that reads back as the same double ("0.002", "3e-4",
// "1e30", "inf", "nan"), with '.' as the decimal point.
std::string format_double(double v);
// `v` with exactly `decimals` digits after a '.' ("2.575").
std::string format_fixed(double v, int decimals);

// How much of a user string a message quotes.
constexpr size_t kQuoteBytes = 200;
// `s` in single quotes for a message: bytes that are control characters or
// not valid UTF-8 as \xNN, and a string longer than `max_bytes` cut there
// (at a character boundary) with "..." and its full length:
// 'abc...' (1048576 bytes).
std::string quote(std::string_view s, size_t max_bytes = kQuoteBytes);
// A path, quoted whole up to PATH_MAX (a longer one cannot name a file).
inline std::string quote_path(std::string_view path) { return quote(path, 4096); }

// Why `name` cannot name a unit or a param, or "" if it can: names are
// non-empty valid UTF-8 without control characters (U+0000-U+001F, U+007F),
// so that checkpoints (JSON, safetensors) hold them and every language reads
// them back as the same string.
std::string name_problem(std::string_view name);

}  // namespace fsdp::base

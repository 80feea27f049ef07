// src/base/text.cpp - see text.h. std::from_chars / std::to_chars never look
// at a locale, unlike strtod, printf and iostreams.
#include "text.h"

#include <charconv>
#include <cmath>
#include <cstdint>
#include <system_error>

namespace fsdp::base {
namespace {

// The length of the valid UTF-8 sequence starting at s[i] (1 to 4), or 0 when
// it is not one: overlong forms, surrogates and code points past U+10FFFF are
// refused, as JSON parsers refuse them.
size_t utf8_sequence(std::string_view s, size_t i) {
  auto at = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  unsigned char c = at(i);
  if (c < 0x80) return 1;
  size_t n;
  uint32_t cp;
  if (c >= 0xc2 && c <= 0xdf) {
    n = 2;
    cp = c & 0x1fu;
  } else if (c >= 0xe0 && c <= 0xef) {
    n = 3;
    cp = c & 0x0fu;
  } else if (c >= 0xf0 && c <= 0xf4) {
    n = 4;
    cp = c & 0x07u;
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((at(i + k) & 0xc0u) != 0x80u) return 0;
    cp = (cp << 6) | (at(i + k) & 0x3fu);
  }
  static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < kMin[n] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
  return n;
}

bool is_control(unsigned char c) { return c < 0x20 || c == 0x7f; }

void append_hex(std::string& out, unsigned char c) {
  static constexpr char kHex[] = "0123456789abcdef";
  out += "\\x";
  out += kHex[c >> 4];
  out += kHex[c & 0xf];
}

// from_chars takes no '+': drops one, and false if what is left cannot start
// a number (empty; or, after the '+', another sign: "+-0" is no number).
bool strip_plus(std::string_view& s) {
  if (s.empty() || s[0] != '+') return !s.empty();
  s.remove_prefix(1);
  return !s.empty() && s[0] != '+' && s[0] != '-';
}

}  // namespace

bool parse_double(std::string_view s, double* out) {
  if (!strip_plus(s)) return false;
  double v = 0.0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v, std::chars_format::general);
  if (ec != std::errc() || end != s.data() + s.size()) return false;
  *out = v;
  return true;
}

bool parse_long(std::string_view s, long* out) {
  if (!strip_plus(s)) return false;
  long v = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v, 10);
  if (ec != std::errc() || end != s.data() + s.size()) return false;
  *out = v;
  return true;
}

std::string format_double(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v < 0 ? "-inf" : "inf";
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  if (ec != std::errc()) return "?";
  // to_chars writes exponents as printf does ("3e-04", "1e+30"): drop the
  // '+' and the leading zeros ("3e-4", "1e30"), still valid JSON and C.
  std::string s(buf, end);
  size_t e = s.find('e');
  if (e == std::string::npos) return s;
  size_t digits = e + 1;
  if (s[digits] == '+') {
    s.erase(digits, 1);
  } else if (s[digits] == '-') {
    ++digits;
  }
  while (s.size() > digits + 1 && s[digits] == '0') s.erase(digits, 1);
  return s;
}

std::string format_fixed(double v, int decimals) {
  if (!std::isfinite(v)) return format_double(v);
  char buf[400];  // DBL_MAX in fixed notation has 309 digits
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::fixed, decimals);
  return ec == std::errc() ? std::string(buf, end) : format_double(v);
}

std::string quote(std::string_view s, size_t max_bytes) {
  std::string out = "'";
  size_t i = 0;
  while (i < s.size()) {
    size_t n = utf8_sequence(s, i);
    if (i + (n == 0 ? 1 : n) > max_bytes) break;
    unsigned char c = static_cast<unsigned char>(s[i]);
    if (n == 0 || (n == 1 && is_control(c))) {
      append_hex(out, c);
      i += 1;
    } else {
      out.append(s.substr(i, n));
      i += n;
    }
  }
  if (i < s.size()) return out + "...' (" + std::to_string(s.size()) + " bytes)";
  return out + "'";
}

std::string name_problem(std::string_view name) {
  if (name.empty()) return "is empty";
  for (size_t i = 0; i < name.size();) {
    size_t n = utf8_sequence(name, i);
    unsigned char c = static_cast<unsigned char>(name[i]);
    if (n == 0 || (n == 1 && is_control(c))) {
      std::string why = n == 0 ? "is not valid UTF-8 (" : "holds a control character (";
      append_hex(why, c);
      return why + " at byte " + std::to_string(i) + ")";
    }
    i += n;
  }
  return "";
}

}  // namespace fsdp::base

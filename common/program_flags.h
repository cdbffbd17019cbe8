// Command-line parsing shared by flashsamplerd, flashsampler-cli and fs_load:
// absl flags, with --help listing the program's own flags and exiting 0, and
// --version printing the project version and the git revision it was built
// from. Header-only; a binary using it links fs_version and absl's flags.
#ifndef FLASHSAMPLER_COMMON_PROGRAM_FLAGS_H_
#define FLASHSAMPLER_COMMON_PROGRAM_FLAGS_H_

#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/internal/parse.h"
#include "absl/flags/internal/usage.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "flashsampler/version.h"

namespace flashsampler {

// "<program> <version> (git <revision>)".
inline std::string VersionLine(absl::string_view program) {
  return absl::StrCat(program, " ", kVersion, " (git ", kGitRevision, ")");
}

struct ParsedCommandLine {
  // argv[0] and the positional arguments, as absl::ParseCommandLine returns.
  std::vector<char*> args;
  // Set when a usage flag (--help, --helpfull, --version, ...) was handled:
  // the program prints nothing more and returns this.
  std::optional<int> exit_code;
};

// absl::ParseCommandLine, except for the usage flags: absl lists with --help
// only the flags of files matching its default filters (none of ours), and
// exits 1 after any help text. Here --help and --helpshort list the flags
// defined in `main_file` (a path suffix such as "client/cli_main.cc"), every
// usage flag prints to stdout and the program exits 0, as operators and
// `docker run image --help` expect. Unknown flags still abort with absl's
// message.
inline ParsedCommandLine ParseProgramFlags(int argc, char** argv,
                                           absl::string_view program,
                                           absl::string_view main_file,
                                           absl::string_view usage) {
  absl::SetProgramUsageMessage(usage);
  absl::FlagsUsageConfig config;
  const std::string main(main_file);
  config.contains_helpshort_flags = [main](absl::string_view file) {
    return absl::EndsWith(file, main);
  };
  config.contains_help_flags = config.contains_helpshort_flags;
  const std::string name(program);
  config.version_string = [name] { return VersionLine(name) + "\n"; };
  absl::SetFlagsUsageConfig(config);

  ParsedCommandLine parsed;
  parsed.args = absl::flags_internal::ParseCommandLineImpl(
      argc, argv, absl::flags_internal::ArgvListAction::kRemoveParsedArgs,
      absl::flags_internal::UsageFlagsAction::kIgnoreUsage,
      absl::flags_internal::OnUndefinedFlag::kAbortIfUndefined);
  const int handled = absl::flags_internal::HandleUsageFlags(
      std::cout, absl::ProgramUsageMessage());
  std::cout.flush();
  if (handled != -1) parsed.exit_code = 0;
  return parsed;
}

}  // namespace flashsampler

#endif  // FLASHSAMPLER_COMMON_PROGRAM_FLAGS_H_

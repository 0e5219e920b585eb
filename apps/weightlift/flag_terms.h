// The libraries name an option in their errors as its field is spelt, in backquotes
// (`trainer_dp_mode`, `rollout_tp`: what a Python or C++ caller passes); the command line's user
// reads the flag they typed. An error on its way to the terminal has every quoted field that is
// a flag of the command written as that flag (--trainer-dp-mode, --rollout-tp), including a few
// fields whose flag is spelt otherwise (flag_terms.cc's table); other quoted words stay.
#pragma once

#include <CLI/CLI.hpp>
#include <string>
#include <string_view>

namespace wl::app {

// Learns the long flags of `app` and of every subcommand under it: called once, after every
// subcommand has registered its flags.
void learn_flags(const CLI::App& app);

// `message` with each `field` that names a learned flag (the flag without its dashes, `-` as
// `_`) written as the flag.
std::string in_flag_terms(std::string_view message);

}  // namespace wl::app

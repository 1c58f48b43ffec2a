# Sourced by run_llama_train.sh and scripts/multinode_trainer.slurm: which config a launch trains.
#   config_args DEFAULT "$@"   sets CONFIG_ARGS to the arguments to put before "$@" (returns 2 after one error line)
# A TOML file: the user's --job.config_file wins over CONFIG_FILE (upstream torchtitan's last-one-wins), with one line
# when both are given and differ; otherwise CONFIG_FILE, else DEFAULT. Two different --job.config_file arguments
# reach the config parser, which refuses them in one line (exit 2).
# A function (configurations as code): --module M --config F, or MODULE=M CONFIG=F as upstream's launcher reads them;
# each argument wins over its variable (one line when they differ), and then no TOML file is added. MODULE/CONFIG
# beside CONFIG_FILE is refused (pick one); an argument of the other kind wins over the variables, with one line.
config_args() {
  local default=$1 cli_config="" cli_module="" cli_function="" prev="" arg
  shift
  for arg in "$@"; do
    case "$arg" in
      --job.config_file=* | --job.config-file=*) cli_config="${arg#*=}" ;;
      --module=*) cli_module="${arg#*=}" ;;
      --config=*) cli_function="${arg#*=}" ;;
    esac
    case "$prev" in
      --job.config_file | --job.config-file) cli_config="$arg" ;;
      --module) cli_module="$arg" ;;
      --config) cli_function="$arg" ;;
    esac
    prev="$arg"
  done
  CONFIG_ARGS=()
  if [ -n "${MODULE:-}${CONFIG:-}" ] && [ -n "${CONFIG_FILE:-}" ] && [ -z "$cli_config$cli_module$cli_function" ]; then
    echo "error: MODULE/CONFIG (a function's config) and CONFIG_FILE=$CONFIG_FILE (a TOML file) are both set: pick" \
      "one (unset CONFIG_FILE, or MODULE and CONFIG)" >&2
    return 2
  fi
  if [ -n "$cli_module$cli_function" ] || { [ -n "${MODULE:-}${CONFIG:-}" ] && [ -z "$cli_config" ]; }; then
    _function_args "$cli_module" "$cli_function"
  elif [ -z "$cli_config" ]; then
    CONFIG_ARGS=(--job.config_file "${CONFIG_FILE:-$default}")
  elif [ -n "${CONFIG_FILE:-}" ] && [ "$CONFIG_FILE" != "$cli_config" ]; then
    echo "note: training with --job.config_file $cli_config (it overrides CONFIG_FILE=$CONFIG_FILE)" >&2
  elif [ -n "${MODULE:-}${CONFIG:-}" ]; then
    echo "note: training with --job.config_file $cli_config (it overrides MODULE/CONFIG)" >&2
  fi
}

# --module/--config from MODULE/CONFIG where the command line lacks them; a note where an argument overrides a variable.
_function_args() {
  local cli_module=$1 cli_function=$2
  if [ -n "${CONFIG_FILE:-}" ]; then
    echo "note: training the function of --module/--config (it overrides CONFIG_FILE=$CONFIG_FILE)" >&2
  fi
  if [ -z "$cli_module" ] && [ -n "${MODULE:-}" ]; then
    CONFIG_ARGS+=(--module "$MODULE")
  elif [ -n "$cli_module" ] && [ -n "${MODULE:-}" ] && [ "$MODULE" != "$cli_module" ]; then
    echo "note: --module $cli_module overrides MODULE=$MODULE" >&2
  fi
  if [ -z "$cli_function" ] && [ -n "${CONFIG:-}" ]; then
    CONFIG_ARGS+=(--config "$CONFIG")
  elif [ -n "$cli_function" ] && [ -n "${CONFIG:-}" ] && [ "$CONFIG" != "$cli_function" ]; then
    echo "note: --config $cli_function overrides CONFIG=$CONFIG" >&2
  fi
}
